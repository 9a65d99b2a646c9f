"""The ``StepSession`` of the in-process store (``worker.testing.memory.MemoryStore``): its
saves are fenced by the store's lease, and it marks the step a turn parks at in the turn's
controls as the Redis store's save script does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from contracts import keys
from contracts.control import TurnCancel, TurnChildResult, TurnDecision
from contracts.messages import ChatMessage
from contracts.state import AgentState, StepExecution
from contracts.turns import TurnResult
from worker.errors import StaleStateError
from worker.session.port import Opening, list_waiting

if TYPE_CHECKING:
    from worker.testing.memory import MemoryStore


class MemoryParked:
    """A parked state, kept as the object it is."""

    __slots__ = ("state",)

    def __init__(self, state: AgentState) -> None:
        self.state = state

    def unpark(self) -> AgentState:
        return self.state


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

    def cancelled(self) -> bool:
        return self.cancel is not None

    async def list_waiting(self, state: AgentState) -> None:
        await list_waiting(self.store, state)

    def park(self, state: AgentState) -> MemoryParked:
        return self.store.park(state)

    async def load_messages(self, state: AgentState) -> list[ChatMessage]:
        return await self.store.load_messages(state)

    async def load_steps(self, state: AgentState) -> list[StepExecution]:
        return await self.store.load_steps(state)

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
        if not self.store._holds(self):
            raise StaleStateError(f"session {self.session_id}: lease lost")
        key = (
            self.session_id,
            self.turn_id or (state.execution.turn_id if state.execution else ""),
        )
        cancel = self.store.controls.get(key, {}).get("cancel")
        if result is None and isinstance(cancel, TurnCancel) and self.cancel is None:
            self.cancel = cancel  # as the save script reads it
        saved, head = self.store._write(state, append, result, step, cut_to)
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
            index = ex.pending.index if ex.pending is not None else ex.step_count
            if self.parked != index:
                controls["parked"] = self.parked = index
                self.controls_waiting = len(controls) > 1
            self.store._expire_controls(key)
            self.store._keep(self.store._lifetime(state), [keys.turn_controls(*key)])
        elif self.parked is not None:
            self.parked = None
            if controls is not None:  # what woke it is in its state now; a cancel stays
                for name in [n for n in controls if n != "cancel"]:
                    del controls[name]
                if controls:
                    self.store._expire_controls(key)
                else:
                    self.store._drop_controls(key)
