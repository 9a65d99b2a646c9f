"""Every RabbitMQ name loopwire uses. These names are the wire protocol: changing one breaks users."""

from __future__ import annotations

from typing import Final

TURNS_QUEUE: Final = "loopwire.turns"
"""Quorum queue of turn work: start a turn, advance a turn by one step."""

DEAD_LETTER_EXCHANGE: Final = "loopwire.turns.dlx"
DEAD_LETTER_QUEUE: Final = "loopwire.turns.dead"
"""Rejected and poison work, bound to the dead-letter exchange, with an ``x-loopwire-reason`` header."""

SESSIONS_QUEUE: Final = "loopwire.sessions"
"""Quorum queue of session reads (``contracts.sessions.SessionQuery``), answered by any worker
to the message's ``reply_to``."""

REQUESTS_EXCHANGE: Final = "loopwire.requests"
"""Direct exchange for publishers: routing key ``loopwire.turns`` or ``loopwire.sessions``
reaches that queue, as the default exchange does with the same key. A publisher's broker user
may write to this exchange alone (the default exchange reaches every queue by its name), so
that it can start and control turns and read sessions, and nothing else."""

INTAKE_EXCHANGE: Final = "loopwire.intake"
"""Topic exchange for a tenant's publishers while tenancy is on (docs/tenants.md, "Fair"):
routing key ``<tenant>.turns`` carries what ``loopwire.turns`` does (turn requests and control
messages) into that tenant's own intake queue, ``loopwire.turns.tenant.<tenant>``, when the
workers keep one for it, so a tenant's backlog queues behind its own work only. A key that no
queue is bound to goes on, through the alternate exchange ``loopwire.intake.fallback``, to
``loopwire.turns``. The key's tenant must be the message's (``tenant_mismatch`` otherwise);
RabbitMQ's topic permissions can hold each user to its own keys (``^{username}\\.``)."""

INTAKE_FALLBACK_EXCHANGE: Final = "loopwire.intake.fallback"
"""Fanout exchange, the intake exchange's alternate: bound to ``loopwire.turns``."""

INTAKE_SUFFIX: Final = ".turns"


def intake_key(tenant: str) -> str:
    """The intake routing key of a tenant: ``<tenant>.turns``."""
    return f"{tenant}{INTAKE_SUFFIX}"


def intake_queue(tenant: str) -> str:
    """A tenant's own intake queue: ``loopwire.turns.tenant.<tenant>``."""
    return f"{TURNS_QUEUE}.tenant.{tenant}"


def intake_tenant(exchange: str | None, routing_key: str | None) -> str | None:
    """The tenant a delivery was published for through the intake exchange, else None (a
    tenant's name has no ``.``: any other key reached ``loopwire.turns`` as an unbound one)."""
    if exchange != INTAKE_EXCHANGE or not routing_key or not routing_key.endswith(INTAKE_SUFFIX):
        return None
    tenant = routing_key[: -len(INTAKE_SUFFIX)]
    return tenant if tenant and "." not in tenant else None


GATEWAY_CONSOLE_QUEUE: Final = "loopwire.gateway.console"
"""Classic queue of the HTTP gateway's replicas (durable; the events it holds are transient, as
published), bound to ``loopwire.events`` for every event (``#``), at most
``GATEWAY_CONSOLE_MAX`` messages (the oldest dropped): whichever replica takes
an event folds it into the console's index of turns and tells every replica's open console
pages (docs/console.md)."""

GATEWAY_CONSOLE_MAX: Final = 100_000

GATEWAY_WEBHOOKS_QUEUE: Final = "loopwire.gateway.webhooks"
"""Quorum queue of the HTTP gateway's replicas, bound to ``loopwire.events`` for every turn's
end (``#.turn.completed.#``, ``#.turn.failed.#``, ``#.turn.cancelled.#``): whichever replica
takes an end sends the webhook its run asked for (docs/http.md)."""

TOOLS_EXCHANGE: Final = "loopwire.tools"
"""Direct exchange for tool calls; routing key = tool name."""

EVENTS_EXCHANGE: Final = "loopwire.events"
"""Topic exchange for lifecycle events; routing key ``<entity>.<action>.<agent>.<turn_id>``."""


TURN_DELIVERY_LIMIT: Final = 20
"""Deliveries of one work message before the quorum queue dead-letters it."""


def tool_queue(tool: str) -> str:
    """The quorum queue of one tool: ``loopwire.tool.<name>``."""
    return f"loopwire.tool.{tool}"


# Message headers
H_REASON: Final = "x-loopwire-reason"
H_REASON_CODE: Final = "x-loopwire-reason-code"
H_IDEMPOTENCY_KEY: Final = "idempotency-key"
H_KIND: Final = "x-loopwire-kind"

# Message kinds on the turn queue
KIND_START: Final = "turn.start"
KIND_STEP: Final = "turn.step"
KIND_CANCEL: Final = "turn.cancel"
"""A control message (``contracts.control.TurnCancel``): end a turn wherever it is."""
KIND_DECISION: Final = "turn.decision"
"""A control message (``contracts.control.TurnDecision``): decide a call a turn waits on."""
KIND_SESSION_DELETE: Final = "session.delete"
"""A ``contracts.sessions.SessionDelete``: delete a session once its turns are cancelled."""
KIND_CHILD_RESULT: Final = "turn.child_result"
"""A control message (``contracts.control.TurnChildResult``): a child turn's result, for its
parent."""

RETRY_QUEUE: Final = "loopwire.turns.retry"
"""Delay queue: work for a busy session (or a step to retry) waits here, then dead-letters back
into ``loopwire.turns``. No worker blocks while a session is busy."""

H_ATTEMPT: Final = "x-loopwire-attempt"
"""How many times a step failed with an unexpected error (retried until ``max_step_attempts``)."""
H_REDONE: Final = "x-loopwire-redone"
"""On work sent to the delay queue after it was taken (a failure, Redis away): the message was
taken before, as a broker's redelivery says (only then does a step that was done publish what
followed it again)."""

CONTENT_TYPE: Final = "application/msgpack"

H_DEAD_ID: Final = "x-loopwire-dead-id"
"""The id of a dead letter, as ``loopwire dlq list`` shows it and ``dlq replay`` takes it."""
H_REJECTED_AT: Final = "x-loopwire-rejected-at"


WAIT_BUCKETS_S: Final = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
"""The wait queues' delays, in seconds. A message's own TTL expires only at the head of its
queue, so one delay queue cannot hold waits of different lengths (an hour-long wait would hold
back every short retry behind it): each wait queue has one queue-wide TTL, and a parked turn's
timeout message hops through them (the longest delay that does not pass its time, again on
arrival until it is due) on its way back to ``loopwire.turns``."""


def wait_queue(seconds: int) -> str:
    """The wait queue of one delay: ``loopwire.turns.wait.<seconds>``."""
    return f"loopwire.turns.wait.{seconds}"


def wait_bucket(remaining_s: float) -> int:
    """The longest wait-queue delay that does not pass ``remaining_s`` (the shortest if none)."""
    fitting = [b for b in WAIT_BUCKETS_S if b <= remaining_s]
    return fitting[-1] if fitting else WAIT_BUCKETS_S[0]
