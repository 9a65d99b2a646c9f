"""Control messages on ``loopwire.turns``: any service may publish them to steer a turn that
is queued, running or parked, without knowing which worker (if any) holds it.

``turn.cancel`` (header ``x-loopwire-kind: turn.cancel``, body ``TurnCancel``) ends a turn
wherever it is: queued behind the session's earlier turns (it never starts), between steps
or parked (at once), running (the step in flight notices within a lease-renewal interval,
abandons the model or tool call it waits for, and the turn ends with what it had). The turn
ends with ``finish_reason: cancelled``, ``stopped_by`` = the reason, and a
``turn.cancelled`` event. A copy of a cancel, or one for a finished or unknown turn, is acked
and dropped with a reason; a malformed one is dead-lettered like a bad turn request.

``session_id`` may be left out: the worker finds the turn's session from its id.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from contracts.base import Contract, SafeId


class TurnCancel(Contract):
    schema_version: Literal[1] = 1
    turn_id: SafeId
    session_id: SafeId | None = None
    reason: str = Field(default="cancelled", min_length=1, max_length=120)
    by: str | None = Field(default=None, max_length=200, description="Who asked (for the log).")
    at: float | None = Field(default=None, description="When it was asked (Unix time).")
