"""Control messages on ``loopwire.turns``: any service may publish a cancel or a decision to
steer a turn that is queued, running or parked, without knowing which worker (if any) holds
it; a child's result only a worker may send.

``turn.cancel`` (header ``x-loopwire-kind: turn.cancel``, body ``TurnCancel``) ends a turn
wherever it is: queued behind the session's earlier turns (it never starts), between steps
or parked (at once), running (the step in flight notices within a lease-renewal interval,
abandons the model or tool call it waits for, and the turn ends with what it had). The turn
ends with ``finish_reason: cancelled``, ``stopped_by`` = the reason, and a
``turn.cancelled`` event. A copy of a cancel, or one for a finished or unknown turn, is acked
and dropped with a reason; a malformed one is dead-lettered like a bad turn request.

``turn.decision`` (body ``TurnDecision``) decides one tool call a turn waits on (a tool the
agent's profile lists under ``approval``): ``approve`` runs it, ``edit`` runs it with the
given arguments, ``reject`` answers the model ``{"error": "rejected by <who>: <message>"}``.
The turn is parked meanwhile (``status: waiting``: no worker holds it); once every call of
the step is decided, any worker resumes it. A call not decided within the agent's
``approval_timeout_s`` is rejected. A second decision for a call is dropped.

``turn.child_result`` (body ``TurnChildResult``) carries a child turn's result to its
parent: the worker that finished the child sends it, with its own AMQP user as ``user_id``,
and a worker takes it from no other user (``worker.transport.senders``). The parent records
it like a tool result of the call that started the child, and goes on once every child of its
step has answered. A copy is dropped; one for a parent that has finished is acked and dropped.

``session_id`` may be left out: the worker finds the turn's session from its id.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from contracts.base import Contract, SafeId
from contracts.turns import TurnParent, TurnResult


class TurnCancel(Contract):
    schema_version: Literal[1] = 1
    turn_id: SafeId
    session_id: SafeId | None = None
    reason: str = Field(default="cancelled", min_length=1, max_length=120)
    by: str | None = Field(default=None, max_length=200, description="Who asked (for the log).")
    at: float | None = Field(default=None, description="When it was asked (Unix time).")
    rollback: bool = Field(
        default=False,
        description="Also remove the turn's messages from the session's history, in the same "
        "write that ends it; a turn that has ended already keeps them.",
    )


Verdict = Literal["approve", "reject", "edit"]


class TurnDecision(Contract):
    schema_version: Literal[1] = 1
    turn_id: SafeId
    session_id: SafeId | None = None
    call_id: str = Field(min_length=1, max_length=128)
    decision: Verdict
    message: str | None = Field(
        default=None, max_length=2000, description="For the model, with a rejection."
    )
    arguments: dict[str, Any] | None = Field(
        default=None, description="With ``edit``: the arguments the call runs with instead."
    )
    by: str | None = Field(default=None, max_length=200, description="Who decided.")
    at: float | None = Field(default=None, description="When (Unix time).")

    @model_validator(mode="after")
    def _edit_has_arguments(self) -> TurnDecision:
        if (self.decision == "edit") != (self.arguments is not None):
            raise ValueError("'arguments' is given exactly with decision 'edit'")
        return self


class ApprovalRequest(Contract):
    """A tool call waiting for a decision, as ``loopwire approvals`` lists it."""

    turn_id: SafeId
    session_id: SafeId
    agent: str
    call_id: str
    tool: str
    arguments: str = Field(description="As the model wrote them (redacted when the agent redacts).")
    since: float
    until: float | None = None


class TurnChildResult(Contract):
    """A child turn's result, for its parent (``parent``: the child's ``TurnRequest.parent``)."""

    schema_version: Literal[1] = 1
    parent: TurnParent
    result: TurnResult
