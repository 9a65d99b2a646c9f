"""In-process implementations of the loop's interfaces.

They run a turn without RabbitMQ or Redis: for unit tests, for embedding the
loop in another program, and as the reference behaviour the Redis store and the
RabbitMQ transports must match.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from contracts.events import Event
from contracts.messages import ChatMessage
from contracts.state import AgentState
from contracts.tools import ToolCallReply, ToolCallRequest, ToolContext, ToolDefinition
from contracts.turns import TurnResult
from worker.errors import StaleStateError

ToolFunction = Callable[[dict[str, Any], ToolContext], Awaitable[Any]]


class MemoryStore:
    """``StateStore`` in a dict, with the same compare-and-set rule as the Redis store."""

    def __init__(self) -> None:
        self.states: dict[str, AgentState] = {}
        self.histories: dict[str, list[ChatMessage]] = {}
        self.transient: dict[str, list[ChatMessage]] = {}
        self.results: dict[str, TurnResult] = {}

    async def load(self, session_id: str) -> AgentState | None:
        return self.states.get(session_id)

    def stored(self, state: AgentState) -> bytes | None:
        return None  # states are kept as objects

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
        stored = self.states.get(state.session_id)
        if (stored.version if stored else 0) != state.version:
            raise StaleStateError(f"session {state.session_id} was written by someone else")
        ex = state.execution
        if append:
            if ex is None or ex.request.persist:
                self.histories.setdefault(state.session_id, []).extend(append)
            else:
                self.transient.setdefault(ex.turn_id, []).extend(append)
        if result is not None:
            self.results[result.turn_id] = result
            self.transient.pop(result.turn_id, None)
        saved = state.model_copy(update={"version": state.version + 1})
        self.states[state.session_id] = saved
        return saved


class StaticCatalog:
    """``ToolCatalog`` with a fixed list of tools."""

    def __init__(self, definitions: Sequence[ToolDefinition] = ()) -> None:
        self.definitions = list(definitions)

    async def available(self) -> Sequence[ToolDefinition]:
        return self.definitions


class FunctionTools:
    """``ToolCaller`` that runs Python coroutines in this process (exceptions become errors)."""

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
        return ToolCallReply(call_id=request.call_id, status="ok", value=value)


class ListSink:
    """``EventSink`` that keeps every event in a list."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    async def emit(self, event: Event) -> None:
        self.events.append(event)

    def types(self) -> list[str]:
        return [event.type for event in self.events]
