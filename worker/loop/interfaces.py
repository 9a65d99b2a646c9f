"""The small interfaces the loop runs over. Transports implement them; the loop knows nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from contracts.events import Event
from contracts.messages import ChatMessage
from contracts.state import AgentState, ModelResponse
from contracts.tools import ToolCallReply, ToolCallRequest, ToolDefinition
from contracts.turns import TurnResult


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """One chat-completions call: the compiled messages and the tools on offer."""

    messages: Sequence[ChatMessage]
    tools: Sequence[ToolDefinition] = ()
    model: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Model(Protocol):
    async def complete(self, request: ModelRequest) -> ModelResponse:
        """Answer or raise ``ModelError``."""
        ...


class ToolCaller(Protocol):
    async def call(self, request: ToolCallRequest, definition: ToolDefinition) -> ToolCallReply:
        """Run one tool call remotely. May raise; the loop turns every failure into an error result."""
        ...


class ToolCatalog(Protocol):
    async def available(self) -> Sequence[ToolDefinition]:
        """The tools that can be called right now."""
        ...


class EventSink(Protocol):
    async def emit(self, event: Event) -> None:
        """Publish a lifecycle event. Events only observe; a failure here must not change the turn."""
        ...


class StateStore(Protocol):
    async def load_messages(self, state: AgentState) -> list[ChatMessage]:
        """The conversation so far: session history before the turn plus this turn's messages."""
        ...

    async def save(
        self,
        state: AgentState,
        *,
        append: Sequence[ChatMessage] = (),
        result: TurnResult | None = None,
    ) -> AgentState:
        """Write ``state`` if nobody wrote since it was loaded; append this turn's new messages.

        Returns the state as stored (its ``version`` advanced). Raises
        ``StaleStateError`` when another writer got there first.
        """
        ...
