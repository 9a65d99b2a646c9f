"""What the sequencer asks the transport to do after it handled a work message: the closed
union ``Action``. The transport (``worker.transport.consumer``) performs them in order and
only then acks the message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contracts.control import TurnCancel, TurnChildResult
from contracts.sessions import SessionDelete, SessionReply
from contracts.state import ChildTurn
from contracts.turns import FinishReason, TurnRequest, TurnResult
from contracts.work import StepWork


@dataclass(frozen=True, slots=True)
class Step:
    """Publish this step message."""

    work: StepWork


@dataclass(frozen=True, slots=True)
class Reply:
    """Send the turn's result to the publisher's reply queue."""

    reply_to: str
    result: TurnResult


@dataclass(frozen=True, slots=True)
class Busy:
    """The session is leased by another worker: retry this message after a delay."""


@dataclass(frozen=True, slots=True)
class Delay:
    """Send this step message (a parked turn's timeout) through the wait queues: it comes
    back at ``work.wait_until``."""

    work: StepWork


@dataclass(frozen=True, slots=True)
class Start:
    """Publish this turn request (a child turn) to ``loopwire.turns``."""

    request: TurnRequest


@dataclass(frozen=True, slots=True)
class Control:
    """Publish this control message to ``loopwire.turns``: a child's result to its parent, a
    parent's cancel to its child, the deletion of a deleted session's child session."""

    message: TurnCancel | TurnChildResult | SessionDelete


@dataclass(frozen=True, slots=True)
class Answer:
    """Send this answer to a request's reply queue (a ``SessionReply``)."""

    reply_to: str
    correlation_id: str
    body: SessionReply


@dataclass(frozen=True, slots=True)
class Drop:
    """Nothing to do (a duplicate or stale message): ack it."""

    reason: str
    code: str = "duplicate"
    """A fixed code for metrics: ``duplicate_request``, ``stale_step``, ``finished_turn``,
    ``missing_request``."""


Action = Step | Reply | Busy | Drop | Delay | Start | Control | Answer


def first_step(session_id: str, turn_id: str) -> Step:
    return Step(StepWork(session_id=session_id, turn_id=turn_id, step=0))


def wake(session_id: str, turn_id: str, parked: int | None) -> list[Action]:
    """The step message that applies a control message to a parked turn (none for a turn that
    is not parked: its next step, or the step running now, sees it)."""
    if parked is None:
        return []
    return [Step(StepWork(session_id=session_id, turn_id=turn_id, step=parked))]


def to_parent(result: TurnResult) -> list[Action]:
    """A child turn's result for its parent (nothing for a turn that is not a child)."""
    if result.parent is None:
        return []
    return [Control(TurnChildResult(parent=result.parent, result=result))]


def cancel_children(
    orphans: Sequence[ChildTurn], turn_id: str, reason: FinishReason | str
) -> list[Action]:
    """A cancel for each child a turn still waited on when it ended (``reason``: how it
    ended), or when its wait for them ended."""
    return [
        Control(
            TurnCancel(
                turn_id=child.turn_id,
                session_id=child.session_id,
                reason=f"parent {reason}",
                by=f"turn {turn_id}",
            )
        )
        for child in orphans
    ]
