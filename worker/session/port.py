"""The session port: what the worker asks of a session store, whichever it is.

``worker.session.store.RedisStore`` is the real one; ``worker.testing.memory.MemoryStore``
keeps the same rules in a dict, and both pass the same contract tests
(``tests/integration/test_session_store_contract.py``).

- ``accept`` records a turn request once per turn id and queues it behind the session's
  earlier turns; a turn id belongs to the session that accepted it first.
- ``take`` takes the session's lease (``None`` when another worker holds it) and hands back a
  ``StepSession``: the loop's ``StateStore`` for that one step, holding the state read with the
  lease. Its saves are fenced by the lease; a save with a result or ``release`` lets the lease
  go, and a result names the session's next turn (``next_turn``).
- ``renew`` keeps a lease alive while a step runs long; ``release`` lets it go.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from contracts.base import Contract
from contracts.control import ApprovalRequest, TurnCancel, TurnChildResult, TurnDecision
from contracts.state import AgentState
from contracts.turns import TurnRequest, TurnResult
from worker.loop.approvals import waiting_list
from worker.loop.ports import StateStore
from worker.loop.turn import turn_of

AcceptStatus = Literal["start", "queued", "pending", "done", "in_use", "erasing"]
ControlStatus = Literal["recorded", "again", "finished", "unknown"]
"""What recording a control message found: ``again`` is a copy of one recorded before (still
applied: the first copy's worker may have died before it could)."""


@dataclass(frozen=True, slots=True)
class Recorded:
    """A control message recorded: its status, and the step its turn is parked at (if it is:
    the recorder then publishes that step, which applies what was recorded)."""

    status: ControlStatus
    parked: int | None = None


EndQueued = Literal["ended", "head", "finished"]
"""Ending a queued turn: ``head`` when it is the session's running turn (ended under the lease
instead)."""
Renewal = Literal["lost", "held", "cancelled"]
"""A lease renewal: lost, held, or held while the step's turn has a cancel recorded."""
RENEWALS: tuple[Renewal, ...] = ("lost", "held", "cancelled")


@dataclass(frozen=True, slots=True)
class Opening:
    """What a turn's first step reads with the lease (``take(..., first=True)``): the session's
    queue head, and the turn's stored request (``None`` when none is stored)."""

    head: str | None
    request: TurnRequest | None


@dataclass(frozen=True, slots=True)
class Accepted:
    """What ``accept`` found: ``start`` (run it now), ``queued`` (behind others),
    ``pending`` (a duplicate of a turn not finished), ``done`` (a duplicate; ``result``),
    ``in_use`` (another session accepted this turn id: refused, nothing recorded), or
    ``erasing`` (the session is being deleted: nothing was written, ask again later)."""

    status: AcceptStatus
    result: TurnResult | None = None
    ahead: int = 0
    accepted_at: float | None = None
    """When the turn was first accepted (``turn.accepted`` carries it, for copies too)."""


class StepSession(StateStore, Protocol):
    """One step's hold on a session: the lease, the state read with it, the loop's store."""

    session_id: str
    turn_id: str
    """The turn the step is for (``""``: none named)."""
    cancel: TurnCancel | None
    """The turn's cancel, when one was recorded before the lease was taken or before one of
    the step's saves (which reads it)."""
    decisions: dict[str, TurnDecision]
    """Decisions recorded for the turn's calls that wait for approval, by call id."""
    children: dict[str, TurnChildResult]
    """Results of the turn's child turns, by the call id that started each."""
    parked: int | None
    """The step the turn is parked at, if it is."""
    controls_waiting: bool
    """After a save that parked the turn: control messages were recorded for it already."""
    token: int
    """The lease's fencing token (strictly increasing per session)."""
    released: bool
    """A save let go of the lease (``release``, or a result): the step wrote its last."""
    next_turn: str | None
    """After a save with a result: the session's next queued turn, if any."""
    replies: tuple[str, ...]
    """After a save with a result: every reply queue the turn's copies named, first first."""
    opening: Opening | None
    """Read with the lease when ``take`` was asked for a turn's first step, else ``None``."""

    def take_state(self) -> AgentState | None:
        """The state read with the lease (``None`` for a new session), handed out once."""
        ...


class SessionStore(Protocol):
    lease_ttl_s: float

    async def accept(self, request: TurnRequest) -> Accepted: ...

    async def take(
        self, session_id: str, turn_id: str = "", *, first: bool = False
    ) -> StepSession | None:
        """Take the session's lease with its state and ``turn_id``'s cancel, if any; ``None``
        when another worker holds it. ``first``: for the turn's first step, the session's
        ``opening`` (queue head, the turn's request) comes in the same read."""
        ...

    async def renew(self, session: StepSession) -> Renewal:
        """Extend the lease: ``lost`` (expired, taken over), ``held``, or ``cancelled`` (held,
        and the step's turn was cancelled meanwhile)."""
        ...

    async def session_of(self, turn_id: str) -> str | None:
        """The session of an accepted turn."""
        ...

    async def record_control(
        self, session_id: str, turn_id: str, field: str, control: Contract
    ) -> Recorded:
        """Record a control message of a turn once under ``field`` (``cancel``,
        ``decision:<call id>``, ``child:<call id>``); read back by ``take`` with the lease."""
        ...

    async def note_children(self, session_id: str, child_sessions: Sequence[str]) -> None:
        """Record sessions the session's turns started children in (deleted with it)."""
        ...

    async def note_approvals(self, requests: Sequence[ApprovalRequest]) -> None:
        """List calls as waiting for a decision (``loopwire approvals``), each until its wait's
        ``until`` (``listed``): an entry never outlives its wait."""
        ...

    async def clear_approvals(self, turn_id: str, call_ids: Sequence[str]) -> None: ...

    async def approvals(self) -> list[ApprovalRequest]:
        """Every call waiting for a decision (the entries past their ``until`` are dropped)."""
        ...

    async def end_queued(
        self, session_id: str, turn_id: str, result: TurnResult
    ) -> tuple[EndQueued, tuple[str, ...]]:
        """End a turn queued behind the running one with ``result``; with the reply queues of
        its copies."""
        ...

    async def release(self, session: StepSession) -> None: ...

    async def head(self, session_id: str) -> str | None:
        """The turn at the head of the session's queue (the one that runs)."""
        ...

    async def request(self, session_id: str, turn_id: str) -> TurnRequest | None:
        """The request of a turn accepted and not yet finished."""
        ...

    async def result(self, session_id: str, turn_id: str) -> TurnResult | None: ...

    async def stored_state(self, session_id: str) -> AgentState | None:
        """The session's state as stored, read without the lease (a finished turn's last step,
        ``ended_step``, announced again with its end)."""
        ...

    async def reply_to(self, session_id: str, turn_id: str) -> tuple[str, ...]:
        """Every reply queue the turn's copies named (kept after the turn finished): a copy
        published while the turn runs gets the result too."""
        ...


def listed(request: ApprovalRequest, now: float) -> bool:
    """Whether an entry of the list of calls waiting for a decision still counts: its wait has
    not timed out (an entry of an earlier version, without ``until``, counts)."""
    return request.until is None or request.until > now


async def list_waiting(store: SessionStore, state: AgentState) -> None:
    """``StepSession.list_waiting`` of every store: the parked turn's undecided calls on the
    store's list of calls waiting for a decision, its decided ones off it."""
    requests, decided = waiting_list(state)
    await store.note_approvals(requests)
    await store.clear_approvals(turn_of(state).turn_id, decided)


def lifetime(state: AgentState, ttl_s: float, now: float) -> int:
    """How long every key of the session lives at least after a save of ``state`` (both
    stores): ``ttl_s``, and a parked turn's ``ttl_s`` past the end of its wait."""
    ex = state.execution
    wait = ex.wait if ex is not None and ex.status == "waiting" else None
    if wait is None or wait.until is None:
        return math.ceil(ttl_s)
    return math.ceil(ttl_s) + max(0, math.ceil(wait.until - now))
