"""Run one tool function for one request and turn every outcome into a ``ToolCallReply``.

Nothing escapes but cancellation: invalid arguments, an exception, a timeout
(the tool's ``timeout_s`` or the call's deadline, whichever comes first) and a
value that cannot travel (not JSON-able, too large) all become an ``error``
reply with a readable message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Final, Literal

from pydantic import ValidationError

from contracts.codec import MAX_MESSAGE_BYTES, encode
from contracts.tools import ToolCallReply, ToolCallRequest
from tool_services.sdk import CallContext, OutcomeUnknown, Tool, ToolError, ToolResult

log = logging.getLogger("loopwire.tool_services")

MAX_ERROR_CHARS: Final = 16_000

RunOutcome = Literal["ok", "error", "timeout"]
"""How a run ended, for metrics: ``timeout`` when the time budget (or the deadline) ran out."""


async def run_tool(
    tool: Tool,
    request: ToolCallRequest,
    ctx: CallContext,
    *,
    clock: Callable[[], float] = time.time,
) -> ToolCallReply:
    """Validate the arguments, run the function under its time budget, build the reply."""
    reply, _outcome = await execute_tool(tool, request, ctx, clock=clock)
    return reply


async def execute_tool(
    tool: Tool,
    request: ToolCallRequest,
    ctx: CallContext,
    *,
    clock: Callable[[], float] = time.time,
) -> tuple[ToolCallReply, RunOutcome]:
    """``run_tool``, also saying how the run ended."""
    try:
        args = tool.args_model.model_validate(request.arguments)
    except ValidationError as exc:
        return error_reply(request.call_id, f"invalid arguments: {describe_errors(exc)}"), "error"
    remaining = ctx.deadline - clock()
    budget = min(tool.timeout_s, remaining)
    if budget <= 0:
        reply = error_reply(request.call_id, "the call's deadline passed before the tool ran")
        return reply, "timeout"
    try:
        async with asyncio.timeout(budget) as scope:
            result = await tool.fn(args, ctx)
    except TimeoutError:
        if not scope.expired():
            log.exception("tool %s raised TimeoutError (call %s)", tool.name, request.call_id)
            return error_reply(request.call_id, "TimeoutError raised by the tool"), "error"
        if budget < tool.timeout_s:
            message = f"the call's deadline passed after {budget:.3g}s"
        else:
            message = f"timed out after {tool.timeout_s:g}s"
        return error_reply(request.call_id, message), "timeout"
    except OutcomeUnknown as exc:
        message = str(exc) or "the tool may or may not have taken effect"
        return error_reply(request.call_id, message, status="unknown"), "error"
    except ToolError as exc:
        return error_reply(request.call_id, str(exc) or "the tool failed"), "error"
    except Exception as exc:
        log.exception("tool %s failed (call %s)", tool.name, request.call_id)
        return error_reply(request.call_id, f"{type(exc).__name__}: {exc}"), "error"
    reply = ok_reply(request.call_id, result)
    return reply, "ok" if reply.status == "ok" else "error"


def ok_reply(call_id: str, result: Any) -> ToolCallReply:
    value, updates = (
        (result.value, dict(result.state_updates))
        if isinstance(result, ToolResult)
        else (result, {})
    )
    try:
        return ToolCallReply(call_id=call_id, status="ok", value=value, state_updates=updates)
    except ValidationError as exc:
        return error_reply(
            call_id, f"the tool returned invalid state updates: {describe_errors(exc)}"
        )


def error_reply(call_id: str, message: str, *, status: str = "error") -> ToolCallReply:
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 1] + "…"
    return ToolCallReply.model_validate(
        {"call_id": call_id, "status": status, "error": message or "error"}
    )


def encode_reply(reply: ToolCallReply) -> bytes:
    """msgpack of the reply; a value that cannot travel becomes an error reply instead."""
    try:
        body = encode(reply)
    except Exception as exc:
        log.warning("reply of call %s cannot be encoded: %s", reply.call_id, exc)
        return encode(
            error_reply(reply.call_id, f"the tool returned a value that is not JSON-able: {exc}")
        )
    if len(body) > MAX_MESSAGE_BYTES:
        return encode(
            error_reply(
                reply.call_id,
                f"the tool's result is {len(body)} bytes; the limit is {MAX_MESSAGE_BYTES}",
            )
        )
    return body


def undecodable_reply(correlation_id: str | None, reason: str) -> bytes | None:
    """The error reply to a call that cannot be decoded (``None``: it has no usable id)."""
    if not correlation_id:
        return None
    try:
        reply = error_reply(correlation_id, f"undecodable tool call: {reason}")
    except ValidationError:
        return None
    return encode_reply(reply)


def describe_errors(exc: ValidationError, limit: int = 5) -> str:
    """``"query: Field required; limit: Input should be a valid integer"``."""
    errors = exc.errors(include_url=False, include_input=False)
    parts = [
        f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}"
        for err in errors[:limit]
    ]
    if len(errors) > limit:
        parts.append(f"and {len(errors) - limit} more")
    return "; ".join(parts)
