"""Work messages on ``loopwire.turns`` besides ``TurnRequest``.

Publishers send ``TurnRequest`` bodies (header ``x-loopwire-kind`` absent or
``turn.start``). Workers send themselves ``StepWork`` (``x-loopwire-kind:
turn.step``): "run step ``step`` of turn ``turn_id`` of session ``session_id``".
A step message for a step that already ran is a harmless duplicate. A parked turn's timeout
is a step message with ``wait_until`` set, sent through the delay queue.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from contracts.base import Contract, SafeId


class StepWork(Contract):
    schema_version: Literal[1] = 1
    session_id: SafeId
    turn_id: SafeId
    step: int = Field(ge=0, le=10_000)
    wait_until: float | None = Field(
        default=None,
        exclude_if=lambda value: value is None,  # added to v1: written only when set
        description="Set on a parked turn's timeout message (sent through the delay queue): "
        "the time its wait ends.",
    )
