"""In-process implementations of the session's port.

They run a turn without RabbitMQ or Redis: for unit tests, for embedding the loop in another
program, for the sequencer's simulation, and as the reference behaviour of the Redis store.
``MemoryStore`` keeps the session port's rules (``worker.session.port``) in dicts, keyed as
the Redis store keys them (a result, a transient list, a turn's controls by session and turn),
each entry expiring as its Redis key does (``worker.testing.keyspace``), and passes the same
contract tests as the Redis store (``tests/integration/test_session_store_contract.py``). Used
directly as a ``StateStore`` it runs turns in this process without leases (``Loop.run_turn``);
``take`` gives a fenced ``StepSession`` as the worker uses it.

Its save (``worker.testing.saving``), its expiry rules (``worker.testing.expiring``) and its
fleet-wide lists (``worker.testing.fleet``) are mixed in from modules of their own; the fenced
session it gives (``MemorySession``) is in ``worker.testing.memory_session``.

The in-process doubles of the loop's ports (``StaticCatalog``, ``FunctionTools``,
``ListSink``) live in ``worker.testing.doubles`` and are importable from here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from contracts import keys
from contracts.base import Contract
from contracts.control import ApprovalRequest, TurnCancel, TurnChildResult, TurnDecision
from contracts.messages import ChatMessage
from contracts.state import AgentState, Spend, StepExecution
from contracts.turns import TurnRequest, TurnResult
from worker.session.port import (
    Accepted,
    EndQueued,
    Opening,
    Recorded,
    Renewal,
    StepSession,
)
from worker.testing.doubles import FunctionTools, ListSink, StaticCatalog, ToolFunction
from worker.testing.fleet import MemoryFleetLists
from worker.testing.keyspace import Keyspace
from worker.testing.memory_session import MemoryParked, MemorySession
from worker.testing.saving import SaveScript

__all__ = [
    "FunctionTools",
    "ListSink",
    "MemoryParked",
    "MemorySession",
    "MemoryStore",
    "StaticCatalog",
    "ToolFunction",
]

DEFAULT_TTL_S = 30 * 24 * 3600
_K = TypeVar("_K")


class MemoryStore(SaveScript, MemoryFleetLists):
    """The session store in dicts, with the Redis store's compare-and-set, lease and expiry
    rules. ``clock`` drives the leases and the keys' expiry (``keys``: every live entry by its
    Redis key's name); ``wall_clock`` is the time a wait's ``until`` is in."""

    def __init__(
        self,
        *,
        lease_ttl_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        ttl_s: float = DEFAULT_TTL_S,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.lease_ttl_s = lease_ttl_s
        self.ttl_s = ttl_s
        self.clock = clock
        self.keys = Keyspace(clock)
        """The leases' time."""
        self.wall_clock = wall_clock
        """The time the waits' ``until`` is in (entries of the approval list expire by it)."""
        self.states: dict[str, AgentState] = {}
        self.histories: dict[str, list[ChatMessage]] = {}
        self.transient: dict[tuple[str, str], list[ChatMessage]] = {}
        """A ``persist: false`` turn's messages, by session and turn."""
        self.steps: dict[tuple[str, str], list[StepExecution]] = {}
        """Each turn's step list (``StepExecution.stored``), by session and turn."""
        self.results: dict[tuple[str, str], TurnResult] = {}
        """Each finished turn's result, by session and turn."""
        self.turns: dict[str, dict[str, str]] = {}
        self.requests: dict[str, dict[str, TurnRequest]] = {}
        self.queues: dict[str, list[str]] = {}
        self.replies: dict[str, dict[str, list[str]]] = {}
        self.accepted_at: dict[tuple[str, str], float] = {}
        self.leases: dict[str, tuple[int, float]] = {}
        self.fences: dict[str, int] = {}
        self.controls: dict[tuple[str, str], dict[str, Contract | int]] = {}
        """Each turn's recorded control messages by field (and ``parked``: its step)."""
        self.sessions_of: dict[str, str] = {}
        self.waiting_approvals: dict[str, ApprovalRequest] = {}
        self.spend: dict[str, Spend] = {}
        """Each agent's spend (one day: the memory store does not age it)."""
        self.children: dict[str, set[str]] = {}
        """The child sessions each session's turns started (``note_children``)."""
        self.erasing: dict[str, int] = {}
        """Sessions being erased, with the erasure's lease token: while that lease is held,
        their accepts are refused (``erasing``)."""

    # -- the session port ---------------------------------------------------------------

    async def accept(self, request: TurnRequest) -> Accepted:
        self.keys.sweep()
        s, t = request.session_id, request.turn_id
        held = self.leases.get(s)
        if held is not None and held[1] > self.clock() and self.erasing.get(s) == held[0]:
            return Accepted("erasing")
        if t not in self.sessions_of:  # SET NX EX, twice the session's lifetime
            self.sessions_of[t] = s
            self.keys.expire(keys.turn_session(t), 2 * self.ttl_s, self._pop(self.sessions_of, t))
        elif self.sessions_of[t] != s:
            return Accepted("in_use")
        self.keys.extend(keys.turn_session(t), 2 * self.ttl_s)
        turns = self.turns.setdefault(s, {})
        if t in turns:
            result = self.results.get((s, t))
            if result:
                return Accepted("done", result=result)
            self._add_reply(s, t, request.reply_to)
            self._keep(self.ttl_s, self._kept(s))
            return Accepted("pending", accepted_at=self.accepted_at.get((s, t)))
        turns[t] = "queued"
        now = self.accepted_at[s, t] = time.time()
        self.requests.setdefault(s, {})[t] = request
        self._add_reply(s, t, request.reply_to)
        queue = self.queues.setdefault(s, [])
        queue.append(t)
        self._expire(keys.session_turns(s), self._pop(self.turns, s))
        self._expire(keys.session_requests(s), self._pop(self.requests, s))
        self._expire(keys.session_queue(s), self._pop(self.queues, s))
        self._keep(self.ttl_s, self._kept(s))
        if len(queue) == 1:
            return Accepted("start", accepted_at=now)
        return Accepted("queued", ahead=len(queue) - 1, accepted_at=now)

    def _add_reply(self, s: str, t: str, reply_to: str | None) -> None:
        """A reply queue more for the turn (each once), the replies hash's expiry renewed."""
        if reply_to:
            replies = self.replies.setdefault(s, {}).setdefault(t, [])
            if reply_to not in replies:
                replies.append(reply_to)
            self._expire(keys.session_replies(s), self._pop(self.replies, s))

    async def take(
        self, session_id: str, turn_id: str = "", *, first: bool = False
    ) -> MemorySession | None:
        self.keys.sweep()
        held = self.leases.get(session_id)
        if held is not None and held[1] > self.clock():
            return None
        token = self.fences.get(session_id, 0) + 1
        self.fences[session_id] = token
        self._expire(keys.session_fence(session_id), self._pop(self.fences, session_id))
        self._keep(self.ttl_s, self._kept(session_id, turn_id)[:-1])  # not the turn's list
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
        self.keys.sweep()
        if not self._holds(session):
            return "lost"
        self.leases[session.session_id] = (session.token, self.clock() + self.lease_ttl_s)
        self._keep(self.ttl_s, self._kept(session.session_id, session.turn_id))
        controls = self.controls.get((session.session_id, session.turn_id), {})
        return "cancelled" if "cancel" in controls else "held"

    async def session_of(self, turn_id: str) -> str | None:
        self.keys.sweep()
        return self.sessions_of.get(turn_id)

    async def record_control(
        self, session_id: str, turn_id: str, field: str, control: Contract
    ) -> Recorded:
        self.keys.sweep()
        status = self.turns.get(session_id, {}).get(turn_id)
        if status is None:
            return Recorded("unknown")
        if status == "done":
            return Recorded("finished")
        key = (session_id, turn_id)
        controls = self.controls.setdefault(key, {})
        parked = controls.get("parked")
        at = parked if isinstance(parked, int) else None
        if field in controls:
            self._expire_controls(key)
            self._keep(self.ttl_s, [*self._kept(session_id), keys.turn_steps(*key)])
            return Recorded("again", at)
        controls[field] = control
        self._expire_controls(key)
        self._keep(self.ttl_s, [*self._kept(session_id), keys.turn_steps(*key)])
        return Recorded("recorded", at)

    async def note_children(self, session_id: str, child_sessions: Sequence[str]) -> None:
        self.keys.sweep()
        if child_sessions:
            self.children.setdefault(session_id, set()).update(child_sessions)
            self._expire(keys.session_children(session_id), self._pop(self.children, session_id))

    async def end_queued(
        self, session_id: str, turn_id: str, result: TurnResult
    ) -> tuple[EndQueued, tuple[str, ...]]:
        self.keys.sweep()
        queue = self.queues.get(session_id, [])
        if queue and queue[0] == turn_id:
            return "head", ()
        if self.turns.get(session_id, {}).get(turn_id) in (None, "done"):
            return "finished", ()
        queue.remove(turn_id)
        self._emptied(keys.session_queue(session_id), self.queues, session_id)
        self.turns[session_id][turn_id] = "done"
        self.requests.get(session_id, {}).pop(turn_id, None)
        self._emptied(keys.session_requests(session_id), self.requests, session_id)
        self._set_result(session_id, turn_id, result)
        self._drop_controls((session_id, turn_id))
        return "ended", tuple(self.replies.get(session_id, {}).get(turn_id, ()))

    async def release(self, session: StepSession) -> None:
        if self._holds(session):
            del self.leases[session.session_id]

    async def head(self, session_id: str) -> str | None:
        self.keys.sweep()
        queue = self.queues.get(session_id)
        return queue[0] if queue else None

    async def request(self, session_id: str, turn_id: str) -> TurnRequest | None:
        self.keys.sweep()
        return self.requests.get(session_id, {}).get(turn_id)

    async def stored_state(self, session_id: str) -> AgentState | None:
        self.keys.sweep()
        return self.states.get(session_id)

    async def result(self, session_id: str, turn_id: str) -> TurnResult | None:
        self.keys.sweep()
        return self.results.get((session_id, turn_id))

    async def reply_to(self, session_id: str, turn_id: str) -> tuple[str, ...]:
        self.keys.sweep()
        return tuple(self.replies.get(session_id, {}).get(turn_id, ()))

    # -- the loop's store, in this process (no lease) -------------------------------------

    async def load(self, session_id: str) -> AgentState | None:
        self.keys.sweep()
        return self.states.get(session_id)

    def cancelled(self) -> bool:
        return False  # a turn run in this process is not cancelled by a message

    def park(self, state: AgentState) -> MemoryParked:
        if self.states.get(state.session_id) != state:
            raise ValueError("only a state as stored is parked (save it first)")
        return MemoryParked(state)

    async def load_messages(self, state: AgentState) -> list[ChatMessage]:
        self.keys.sweep()
        history = self.histories.get(state.session_id, [])
        ex = state.execution
        if ex is None or ex.request.persist:
            return list(history)
        own = self.transient.get((state.session_id, ex.turn_id), [])
        return [*history[: ex.history_start], *own]

    async def load_steps(self, state: AgentState) -> list[StepExecution]:
        self.keys.sweep()
        ex = state.execution
        if ex is None:
            return []
        return [*ex.steps, *self.steps.get((state.session_id, ex.turn_id), [])]

    async def save(
        self,
        state: AgentState,
        *,
        append: Sequence[ChatMessage] = (),
        result: TurnResult | None = None,
        release: bool = False,
        step: StepExecution | None = None,
        cut_to: int | None = None,
    ) -> AgentState:
        saved, _ = self._write(state, append, result, step, cut_to)
        return saved

    # -- shared by both ---------------------------------------------------------------

    def _holds(self, session: StepSession) -> bool:
        held = self.leases.get(session.session_id)
        return held is not None and held[0] == session.token and held[1] > self.clock()
