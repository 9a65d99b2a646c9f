"""Every RabbitMQ name loopwire uses. These names are the wire protocol: changing one breaks users."""

from __future__ import annotations

from typing import Final

TURNS_QUEUE: Final = "loopwire.turns"
"""Quorum queue of turn work: start a turn, advance a turn by one step."""

DEAD_LETTER_EXCHANGE: Final = "loopwire.turns.dlx"
DEAD_LETTER_QUEUE: Final = "loopwire.turns.dead"
"""Rejected and poison work, bound to the dead-letter exchange, with an ``x-loopwire-reason`` header."""

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

RETRY_QUEUE: Final = "loopwire.turns.retry"
"""Delay queue: work for a busy session (or a step to retry) waits here, then dead-letters back
into ``loopwire.turns``. No worker blocks while a session is busy."""

H_ATTEMPT: Final = "x-loopwire-attempt"
"""How many times a step failed with an unexpected error (retried until ``max_step_attempts``)."""

CONTENT_TYPE: Final = "application/msgpack"

H_DEAD_ID: Final = "x-loopwire-dead-id"
"""The id of a dead letter, as ``loopwire dlq list`` shows it and ``dlq replay`` takes it."""
H_REJECTED_AT: Final = "x-loopwire-rejected-at"
