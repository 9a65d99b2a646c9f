"""In-process doubles of the loop's ports: a fixed tool catalog, tools that are Python
coroutines, and an event sink that keeps every event."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from contracts.events import Event
from contracts.tools import ToolCallReply, ToolCallRequest, ToolContext, ToolDefinition

ToolFunction = Callable[[dict[str, Any], ToolContext], Awaitable[Any]]


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
