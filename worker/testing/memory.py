"""In-process implementations of the loop's and the session's ports.

They run a turn without RabbitMQ or Redis: for unit tests, for embedding the loop in another
program, and as the reference behaviour of the Redis store. ``MemoryStore`` keeps the session
port's rules (``worker.session.port``) in dicts, and passes the same contract tests as the
Redis store (``tests/integration/test_session_store_contract.py``). Used directly as a ``StateStore`` it
runs turns in this process without leases (``Loop.run_turn``); ``take`` gives a fenced
``StepSession`` as the worker uses it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from contracts.base import Contract
from contracts.control import ApprovalRequest, TurnCancel, TurnChildResult, TurnDecision
from contracts.events import Event
from contracts.messages import ChatMessage
from contracts.state import AgentState, Spend
from contracts.tools import ToolCallReply, ToolCallRequest, ToolContext, ToolDefinition
from contracts.turns import TurnRequest, TurnResult
from worker.errors import StaleStateError
from worker.session.port import (
    Accepted,
    EndQueued,
    Opening,
    Recorded,
    Renewal,
    StepSession,
    list_waiting,
    listed,
)

ToolFunction = Callable[[dict[str, Any], ToolContext], Awaitable[Any]]


class MemoryParked:
    """A parked state, kept as the object it is."""

    __slots__ = ("state",)

    def __init__(self, state: AgentState) -> None:
        self.state = state

    def unpark(self) -> AgentState:
        return self.state


class MemoryStore:
    """The session store in dicts, with the Redis store's compare-and-set and lease rules."""

    def __init__(
        self,
        *,
        lease_ttl_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.lease_ttl_s = lease_ttl_s
        self.clock = clock
        """The leases' time."""
        self.wall_clock = wall_clock
        """The time the waits' ``until`` is in (entries of the approval list expire by it)."""
        self.states: dict[str, AgentState] = {}
        self.histories: dict[str, list[ChatMessage]] = {}
        self.transient: dict[str, list[ChatMessage]] = {}
        self.results: dict[str, TurnResult] = {}
        self.turns: dict[str, dict[str, str]] = {}
        self.requests: dict[str, dict[str, TurnRequest]] = {}
        self.queues: dict[str, list[str]] = {}
        self.replies: dict[str, dict[str, list[str]]] = {}
        self.accepted_at: dict[str, float] = {}
        self.leases: dict[str, tuple[int, float]] = {}
        self.fences: dict[str, int] = {}
        self.controls: dict[tuple[str, str], dict[str, Contract | int]] = {}
        """Each turn's recorded control messages by field (and ``parked``: its step)."""
        self.sessions_of: dict[str, str] = {}
        self.waiting_approvals: dict[str, ApprovalRequest] = {}
        self.spend: dict[str, Spend] = {}
        """Each agent's spend (one day: the memory store does not age it)."""

    # -- the session port ---------------------------------------------------------------

    async def accept(self, request: TurnRequest) -> Accepted:
        s, t = request.session_id, request.turn_id
        turns = self.turns.setdefault(s, {})
        self.sessions_of.setdefault(t, s)
        replies = self.replies.setdefault(s, {}).setdefault(t, [])
        if t in turns:
            result = self.results.get(t)
            if result:
                return Accepted("done", result=result)
            if request.reply_to and request.reply_to not in replies:
                replies.append(request.reply_to)
            return Accepted("pending", accepted_at=self.accepted_at.get(t))
        turns[t] = "queued"
        now = self.accepted_at[t] = time.time()
        self.requests.setdefault(s, {})[t] = request
        if request.reply_to:
            replies.append(request.reply_to)
        queue = self.queues.setdefault(s, [])
        queue.append(t)
        if len(queue) == 1:
            return Accepted("start", accepted_at=now)
        return Accepted("queued", ahead=len(queue) - 1, accepted_at=now)

    async def take(
        self, session_id: str, turn_id: str = "", *, first: bool = False
    ) -> MemorySession | None:
        held = self.leases.get(session_id)
        if held is not None and held[1] > self.clock():
            return None
        token = self.fences.get(session_id, 0) + 1
        self.fences[session_id] = token
        self.leases[session_id] = (token, self.clock() + self.lease_ttl_s)
        session = MemorySession(self, session_id, token, self.states.get(session_id))
        session.turn_id = turn_id
        for field, value in self.controls.get((session_id, turn_id), {}).items():
            if isinstance(value, TurnCancel):
                session.cancel = value
            elif isinstance(value, TurnDecision):
                session.decisions[field[9:]] = value
            elif isinstance(value, TurnChildResult):
                session.children[field[6:]] = value
            elif isinstance(value, int):
                session.parked = value
        if first:
            queue = self.queues.get(session_id)
            request = self.requests.get(session_id, {}).get(turn_id)
            session.opening = Opening(queue[0] if queue else None, request)
        return session

    async def renew(self, session: StepSession) -> Renewal:
        if not self._holds(session):
            return "lost"
        self.leases[session.session_id] = (session.token, self.clock() + self.lease_ttl_s)
        controls = self.controls.get((session.session_id, session.turn_id), {})
        return "cancelled" if "cancel" in controls else "held"

    async def session_of(self, turn_id: str) -> str | None:
        return self.sessions_of.get(turn_id)

    async def record_control(
        self, session_id: str, turn_id: str, field: str, control: Contract
    ) -> Recorded:
        status = self.turns.get(session_id, {}).get(turn_id)
        if status is None:
            return Recorded("unknown")
        if status == "done":
            return Recorded("finished")
        controls = self.controls.setdefault((session_id, turn_id), {})
        parked = controls.get("parked")
        at = parked if isinstance(parked, int) else None
        if field in controls:
            return Recorded("again", at)
        controls[field] = control
        return Recorded("recorded", at)

    async def spent_today(self, agent: str) -> Spend:
        return self.spend.get(agent, Spend())

    async def add_spent(self, agent: str, spend: Spend) -> None:
        self.spend[agent] = self.spend.get(agent, Spend()) + spend

    async def note_approvals(self, requests: Sequence[ApprovalRequest]) -> None:
        for r in requests:
            self.waiting_approvals[f"{r.turn_id}:{r.call_id}"] = r

    async def clear_approvals(self, turn_id: str, call_ids: Sequence[str]) -> None:
        for call_id in call_ids:
            self.waiting_approvals.pop(f"{turn_id}:{call_id}", None)

    async def approvals(self) -> list[ApprovalRequest]:
        now = self.wall_clock()
        for field, r in list(self.waiting_approvals.items()):
            if not listed(r, now):
                del self.waiting_approvals[field]
        return sorted(self.waiting_approvals.values(), key=lambda r: r.since)

    async def end_queued(
        self, session_id: str, turn_id: str, result: TurnResult
    ) -> tuple[EndQueued, tuple[str, ...]]:
        queue = self.queues.get(session_id, [])
        if queue and queue[0] == turn_id:
            return "head", ()
        if self.turns.get(session_id, {}).get(turn_id) in (None, "done"):
            return "finished", ()
        queue.remove(turn_id)
        self.turns[session_id][turn_id] = "done"
        self.requests.get(session_id, {}).pop(turn_id, None)
        self.results[turn_id] = result
        self.controls.pop((session_id, turn_id), None)
        return "ended", tuple(self.replies.get(session_id, {}).get(turn_id, ()))

    async def release(self, session: StepSession) -> None:
        if self._holds(session):
            del self.leases[session.session_id]

    async def head(self, session_id: str) -> str | None:
        queue = self.queues.get(session_id)
        return queue[0] if queue else None

    async def request(self, session_id: str, turn_id: str) -> TurnRequest | None:
        return self.requests.get(session_id, {}).get(turn_id)

    async def result(self, session_id: str, turn_id: str) -> TurnResult | None:
        result = self.results.get(turn_id)
        return result if result is not None and result.session_id == session_id else None

    async def reply_to(self, session_id: str, turn_id: str) -> tuple[str, ...]:
        return tuple(self.replies.get(session_id, {}).get(turn_id, ()))

    # -- the loop's store, in this process (no lease) -------------------------------------

    async def load(self, session_id: str) -> AgentState | None:
        return self.states.get(session_id)

    def park(self, state: AgentState) -> MemoryParked:
        if self.states.get(state.session_id) != state:
            raise ValueError("only a state as stored is parked (save it first)")
        return MemoryParked(state)

    async def load_messages(self, state: AgentState) -> list[ChatMessage]:
        history = self.histories.get(state.session_id, [])
        ex = state.execution
        if ex is None or ex.request.persist:
            return list(history)
        return [*history[: ex.history_start], *self.transient.get(ex.turn_id, [])]

    async def save(
        self,
        state: AgentState,
        *,
        append: Sequence[ChatMessage] = (),
        result: TurnResult | None = None,
        release: bool = False,
    ) -> AgentState:
        saved, _ = self._write(state, append, result)
        return saved

    # -- shared by both ---------------------------------------------------------------

    def _holds(self, session: StepSession) -> bool:
        held = self.leases.get(session.session_id)
        return held is not None and held[0] == session.token and held[1] > self.clock()

    def _write(
        self, state: AgentState, append: Sequence[ChatMessage], result: TurnResult | None
    ) -> tuple[AgentState, str | None]:
        sid = state.session_id
        stored = self.states.get(sid)
        if (stored.version if stored else 0) != state.version:
            raise StaleStateError(f"session {sid} was written by someone else")
        ex = state.execution
        if append:
            if ex is None or ex.request.persist:
                self.histories.setdefault(sid, []).extend(append)
            else:
                self.transient.setdefault(ex.turn_id, []).extend(append)
        head = None
        if result is not None:
            t = result.turn_id
            self.results[t] = result
            self.turns.setdefault(sid, {})[t] = "done"
            queue = self.queues.get(sid, [])
            if queue and queue[0] == t:
                queue.pop(0)
            self.requests.get(sid, {}).pop(t, None)
            self.transient.pop(t, None)
            self.controls.pop((sid, t), None)
            head = queue[0] if queue else None
        saved = state.model_copy(update={"version": state.version + 1})
        self.states[sid] = saved
        return saved, head


class MemorySession:
    """``StepSession`` of the ``MemoryStore``: its saves are fenced by the lease."""

    def __init__(
        self, store: MemoryStore, session_id: str, token: int, state: AgentState | None
    ) -> None:
        self.store = store
        self.session_id = session_id
        self.turn_id = ""
        self.cancel: TurnCancel | None = None
        self.decisions: dict[str, TurnDecision] = {}
        self.children: dict[str, TurnChildResult] = {}
        self.parked: int | None = None
        self.controls_waiting = False
        self.token = token
        self._state = state
        self.released = False
        self.next_turn: str | None = None
        self.replies: tuple[str, ...] = ()
        self.opening: Opening | None = None

    def take_state(self) -> AgentState | None:
        state, self._state = self._state, None
        return state

    async def list_waiting(self, state: AgentState) -> None:
        await list_waiting(self.store, state)

    def park(self, state: AgentState) -> MemoryParked:
        return self.store.park(state)

    async def load_messages(self, state: AgentState) -> list[ChatMessage]:
        return await self.store.load_messages(state)

    async def save(
        self,
        state: AgentState,
        *,
        append: Sequence[ChatMessage] = (),
        result: TurnResult | None = None,
        release: bool = False,
    ) -> AgentState:
        if not self.store._holds(self):
            raise StaleStateError(f"session {self.session_id}: lease lost")
        saved, head = self.store._write(state, append, result)
        self._mark_parked(state)
        if result is not None:
            self.next_turn = head
            self.replies = tuple(
                self.store.replies.get(self.session_id, {}).get(result.turn_id, ())
            )
        if release or result is not None:
            await self.store.release(self)
            self.released = True
        return saved

    def _mark_parked(self, state: AgentState) -> None:
        """As the Redis store's save script: the step a turn parks at, in its controls."""
        ex = state.execution
        key = (self.session_id, self.turn_id or (ex.turn_id if ex else ""))
        controls = self.store.controls.get(key)
        if ex is not None and ex.status == "waiting":
            controls = self.store.controls.setdefault(key, {})
            index = ex.pending.index if ex.pending is not None else len(ex.steps)
            if self.parked != index:
                controls["parked"] = self.parked = index
                self.controls_waiting = len(controls) > 1
        elif self.parked is not None:
            self.parked = None
            if controls is not None:  # what woke it is in its state now; a cancel stays
                for name in [n for n in controls if n != "cancel"]:
                    del controls[name]


class StaticCatalog:
    """``ToolCatalog`` with a fixed list of tools."""

    def __init__(self, definitions: Sequence[ToolDefinition] = ()) -> None:
        self.definitions = list(definitions)

    async def available(self) -> Sequence[ToolDefinition]:
        return self.definitions

    def last_known(self, name: str) -> ToolDefinition | None:
        return next((d for d in self.definitions if d.name == name), None)


class FunctionTools:
    """``ToolCaller`` that runs Python coroutines in this process (exceptions become errors; a
    function returning a ``ToolCallReply`` answers with it as it is, ``state_updates`` too)."""

    def __init__(self, functions: Mapping[str, ToolFunction]) -> None:
        self.functions = dict(functions)
        self.calls: list[ToolCallRequest] = []

    async def call(self, request: ToolCallRequest, definition: ToolDefinition) -> ToolCallReply:
        self.calls.append(request)
        function = self.functions[request.tool]
        try:
            value = await function(request.arguments, request.context)
        except Exception as exc:
            return ToolCallReply(
                call_id=request.call_id, status="error", error=f"{type(exc).__name__}: {exc}"
            )
        if isinstance(value, ToolCallReply):
            return value.model_copy(update={"call_id": request.call_id})
        return ToolCallReply(call_id=request.call_id, status="ok", value=value)


class ListSink:
    """``EventSink`` that keeps every event in a list."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    async def emit(self, event: Event) -> None:
        self.events.append(event)

    def types(self) -> list[str]:
        return [event.type for event in self.events]
