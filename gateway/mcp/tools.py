"""An exposed agent as an MCP tool: its listing, its arguments, and its result.

The tool's name is the agent's (or workflow's). Its arguments are the agent-as-tool shape
(``{"input": string}``) plus an optional ``session_id``: the same id in later calls continues
one conversation (the agent sees the earlier exchanges), none runs each call in a fresh
session. An agent with structured output lists it as the tool's ``outputSchema`` (under an
``output`` property when its root is not an object, which MCP versions before 2026-07-28
require) and answers with it as ``structuredContent``; so does a workflow whose output's
schema its nodes tell (``worker.cli.mcp`` derives it).

A turn that answered (``finish_reason`` ``stop``, ``length`` or ``budget``: a budget's end is
a graceful answer) is a result; any other end (failed, cancelled, stopped at its iteration
cap, rejected) is a result with ``isError`` and a sentence saying why, so the calling model
never takes it for an answer. Every result's ``_meta`` names the turn and its session.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import mcp_types as types
from pydantic import Field, ValidationError

from contracts.base import SAFE_ID_PATTERN, Contract, SafeId
from contracts.turns import TurnResult

META_PREFIX: Final = "loopwire/"
"""The prefix of the keys loopwire puts in a result's ``_meta``."""
ANSWERS: Final = frozenset({"stop", "length", "budget"})
"""The finish reasons whose content is the agent's answer."""
MAX_INPUT_CHARS: Final = 100_000


@dataclass(frozen=True, slots=True)
class ExposedTool:
    """An agent (or workflow) offered as an MCP tool."""

    name: str
    description: str
    output_schema: Mapping[str, Any] | None = None

    @property
    def wraps_output(self) -> bool:
        """Whether the output schema's root is not an object (sent under ``output``)."""
        return self.output_schema is not None and self.output_schema.get("type") != "object"

    def listing(self) -> types.Tool:
        output: dict[str, Any] | None = None
        if self.output_schema is not None:
            output = dict(self.output_schema)
            if self.wraps_output:
                output = {
                    "type": "object",
                    "properties": {"output": output},
                    "required": ["output"],
                }
        return types.Tool(
            name=self.name,
            description=self.description or None,
            input_schema=INPUT_SCHEMA,
            output_schema=output,
            annotations=types.ToolAnnotations(read_only_hint=False, open_world_hint=True),
        )


INPUT_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "input": {
            "type": "string",
            "description": "What to ask the agent.",
            "maxLength": MAX_INPUT_CHARS,
        },
        "session_id": {
            "type": "string",
            "pattern": SAFE_ID_PATTERN,
            "description": "Keep a conversation: later calls with the same id continue it (the "
            "agent sees the earlier exchanges). Without one, each call is a new conversation.",
        },
    },
    "required": ["input"],
    "additionalProperties": False,
}


class CallArguments(Contract):
    input: str = Field(max_length=MAX_INPUT_CHARS)
    session_id: SafeId | None = None


def parse_arguments(arguments: Mapping[str, Any] | None) -> CallArguments | str:
    """The call's arguments, or a sentence saying what is wrong with them."""
    try:
        return CallArguments.model_validate(dict(arguments or {}))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}" for e in exc.errors()
        )
        return f"invalid arguments: {problems}"


def error_result(text: str, meta: dict[str, Any] | None = None) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(text=text)], is_error=True, meta=meta or None
    )


def turn_meta(turn_id: str, session_id: str, finish_reason: str | None = None) -> dict[str, Any]:
    meta = {f"{META_PREFIX}turn_id": turn_id, f"{META_PREFIX}session_id": session_id}
    if finish_reason is not None:
        meta[f"{META_PREFIX}finish_reason"] = finish_reason
    return meta


def tool_result(tool: ExposedTool, result: TurnResult) -> types.CallToolResult:
    """The MCP result of a finished turn."""
    meta = turn_meta(result.turn_id, result.session_id, result.finish_reason)
    content = result.content or ""
    if result.finish_reason not in ANSWERS:
        return error_result(_why(result), meta)
    if tool.output_schema is None:
        return types.CallToolResult(content=[types.TextContent(text=content)], meta=meta)
    if result.output is None:  # the schema promises structured content: no answer without it
        return error_result(f"the agent answered without its structured output: {content}", meta)
    structured = {"output": result.output} if tool.wraps_output else result.output
    return types.CallToolResult(
        content=[types.TextContent(text=content)], structured_content=structured, meta=meta
    )


def _why(result: TurnResult) -> str:
    last = f" Its last words: {result.content}" if result.content else ""
    if result.finish_reason == "max_iterations":
        return f"The agent stopped at its iteration cap without an answer.{last}"
    if result.finish_reason == "cancelled":
        return f"The turn was cancelled ({result.stopped_by or 'cancelled'}).{last}"
    error = result.error
    what = f"{error.code}: {error.message}" if error is not None else result.finish_reason
    return f"The turn failed ({what}).{last}"
