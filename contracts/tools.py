"""Tool wire types: definitions announced by tool services, call requests and replies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from contracts.base import AgentName, CallId, Contract, JsonObject, SafeId, ToolName
from contracts.tenancy import scoped


class ToolDefinition(Contract):
    """What the model sees of a tool, plus how workers must call it."""

    schema_version: Literal[1] = 1
    name: ToolName
    description: str = Field(default="", max_length=8000)
    parameters: JsonObject = Field(default_factory=lambda: {"type": "object", "properties": {}})
    timeout_s: float = Field(default=30.0, gt=0, le=3600)
    idempotent: bool = True
    approval: bool = Field(
        default=False,
        description="Every call waits for a human's decision, whichever agent makes it (as if "
        "the agent listed the tool under `approval`); the agent's `approval_timeout_s` applies.",
        exclude_if=lambda value: not value,  # added to v1: written only when set
    )

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


MAX_STATE_CHARS = 16_000
"""The session's key-value state goes with a tool call up to this size (as JSON)."""


class ToolContext(Contract):
    """The call's context, handed to the tool function."""

    session_id: SafeId
    turn_id: SafeId
    agent: AgentName
    metadata: JsonObject = Field(default_factory=dict)
    deadline: float = Field(description="Unix time after which the caller no longer waits.")
    idempotency_key: str = Field(max_length=400)
    state: JsonObject = Field(
        default_factory=dict,
        description="The session's key-value state (sent when it is at most MAX_STATE_CHARS of "
        "JSON).",
        exclude_if=lambda value: not value,  # added to v1: written only when set
    )
    tenant: SafeId | None = Field(
        default=None,
        description="The tenant the call's turn belongs to, while tenancy is on: a tool's "
        "session-scoped data lives within it (the SDK's server acts for it around the call).",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )


class ToolCallRequest(Contract):
    """Body of a tool RPC message (``loopwire.tools`` → ``loopwire.tool.<name>``)."""

    schema_version: Literal[1] = 1
    call_id: CallId
    tool: ToolName
    arguments: JsonObject
    context: ToolContext


ReplyStatus = Literal["ok", "error", "unknown"]


class ToolCallReply(Contract):
    """Body of a tool RPC reply.

    ``ok`` carries ``value``; ``error`` carries a readable ``error``; ``unknown``
    means a non-idempotent call was interrupted earlier and may or may not have
    run, so it is not run again. ``state_updates`` are merged into the session's
    key-value state by the worker.
    """

    schema_version: Literal[1] = 1
    call_id: CallId
    status: ReplyStatus
    value: Any = None
    error: str | None = Field(default=None, max_length=16_000)
    state_updates: JsonObject = Field(default_factory=dict)


def idempotency_key(turn_id: str, call_id: str) -> str:
    """``<turn_id>:<tool_call_id>``: the same call of the same turn is the same key
    (``<tenant>/<turn_id>:<tool_call_id>`` within a tenant other than ``default``)."""
    return f"{scoped(turn_id)}:{call_id}"


class ToolAnnouncement(Contract):
    """A tool service instance announcing the tools it serves; refreshed every heartbeat.

    Stored in the Redis hash ``keys.tool_registry()`` under ``instance_id``; an
    announcement whose ``expires_at`` has passed is ignored (the service is gone).
    """

    schema_version: Literal[1] = 1
    service: str = Field(max_length=128)
    instance_id: str = Field(max_length=128)
    tools: tuple[ToolDefinition, ...]
    announced_at: float
    expires_at: float
