"""Redaction: the model provider never sees customer data; tools still get the real values.

An agent profile turns it on with ``"hooks": ["redact"]`` and configures it in
its ``redaction`` block (``worker.redaction.config``). The hook set
(``worker.redaction.hooks``) works on the loop's hook points:

- *prepare messages*: every message the model will see — system prompt, the
  session's earlier history, this turn's input, tool results — has each
  detected value replaced by a placeholder that is stable for the session
  (``«EMAIL_1»``; the same value always gets the same one);
- *before a tool runs*: placeholders in the arguments are restored, deep in
  nested objects and lists. A placeholder the session does not know, or a
  mangled one (``«EMAIL_1``, ``<EMAIL_1>``), is left as written and recorded
  in ``ToolExecution.unresolved_placeholders`` and the ``tool.invoked`` event. A call to a
  sub-agent is not restored: the child turn gets the placeholders, never the values;
- *after a tool returned*: its value, error and content are redacted with the
  session's placeholders before anything stores, publishes or shows them (a
  tool error that echoes an argument is redacted like a result);
- the publisher's copy of the final answer has its placeholders restored when
  ``restore_answer`` is on (default). The stored ``TurnResult`` and the
  ``turn.completed`` event keep the placeholders (``SessionSequencer(deliver=...)``).

Decisions:

- The mapping lives in Redis (``contracts.keys.redaction_map``, the session's
  hash tag) with a TTL refreshed on use — by default the worker's state TTL —
  so any worker restores it, a worker killed mid-turn loses nothing, and it
  lives as long as the history that refers to it. A placeholder only resolves
  in its own session.
- The session history is the operator's own store and is kept as the loop
  writes it: the user's input as sent (raw), the model's messages as the model
  wrote them (placeholders), tool results as redacted by the hook. The model
  never reads the history directly: it is redacted again before every call,
  so earlier turns, and history from before redaction was turned on, are
  covered too. The raw values a tool returned are never stored.
- ``ToolExecution.arguments`` keeps the model's arguments (placeholders); the
  restored arguments exist only in the tool call sent to the tool service.
- Events, logs and dead-letter reasons never carry a redacted value: the loop
  publishes tool errors and results only after ``after_tool``; this package
  logs call ids, counts and the model's own placeholder tokens only. A Redis
  failure in a hook fails the step (it is retried): the model is never called
  with unredacted messages and a tool never gets a placeholder by accident.

Limits: the tool services (and the broker on the way to them) see the real
values, by design; ``state_updates`` a tool returns are stored in the session's
key-value state as they are; detection is pattern-based (see
``worker.redaction.detectors``), so a value in a shape no detector knows is not
redacted — list such values as literals or patterns.
"""

from typing import Final

REDACT: Final = "redact"
"""The name of the built-in hook set in ``AgentProfile.hooks``."""
