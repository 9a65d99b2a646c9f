"""Chat messages in the OpenAI chat-completions shape, as loopwire stores and sends them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from contracts.base import CallId, Contract

Role = Literal["system", "user", "assistant", "tool"]


class ToolCall(Contract):
    """One function call requested by the model; ``arguments`` is the raw JSON text it produced."""

    id: CallId
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(default="{}", max_length=1_000_000)


class ChatMessage(Contract):
    """One message of a conversation.

    ``content`` may be ``None`` or empty on an assistant message that only calls
    tools; such a message is still recorded, because the tool results that follow
    refer to its call ids. A ``tool`` message always carries ``tool_call_id``.
    """

    role: Role
    content: str | None = Field(default=None, max_length=4_000_000)
    name: str | None = Field(default=None, max_length=256)
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: CallId | None = None

    @classmethod
    def user(cls, content: str) -> ChatMessage:
        return cls(role="user", content=content)

    @classmethod
    def system(cls, content: str) -> ChatMessage:
        return cls(role="system", content=content)

    @classmethod
    def tool(cls, tool_call_id: str, content: str) -> ChatMessage:
        return cls(role="tool", tool_call_id=tool_call_id, content=content)


class Usage(Contract):
    """Token usage, summed over model calls."""

    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    total_tokens: int = Field(default=0, ge=0)

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            total_tokens=self.total_tokens + other.total_tokens,
        )
