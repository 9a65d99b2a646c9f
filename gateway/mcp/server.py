"""An MCP server whose tools are loopwire agents: a call is a turn, published through the
publisher client (``contracts.client``), and its answer is the turn's result.

- ``tools/list``: each ``ExposedTool`` (``gateway.mcp.tools``).
- ``tools/call``: publishes a turn for the agent (in the caller's ``session_id``, or a new
  session) with a deadline of ``timeout_s``, tells the caller its progress from the turn's
  events (``gateway.mcp.progress``), and answers with its result. Past the deadline the
  turn ends itself (``cancelled``, ``stopped_by: deadline``); if even its result does not
  come within a grace after it, the call is answered with an error and the turn is sent
  ``turn.cancel``.
- A call the caller cancels (``notifications/cancelled``, or its connection gone) sends
  ``turn.cancel`` for its turn: the turn ends wherever it is, and its answer goes nowhere.

The SDK's low-level ``Server`` is used, not its decorator front end: the tools are data (an
agents file), not Python functions. One ``LoopwireClient`` (one AMQP connection) serves every
call of every MCP session; each call has its own turn handle (on the client's one reply queue).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Final

import anyio
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError

from contracts.client import LoopwireClient, TurnHandle, TurnRejectedError
from contracts.runtime.metrics import package_version
from gateway.mcp.metrics import McpMetrics, Outcome
from gateway.mcp.progress import TurnProgress
from gateway.mcp.tools import (
    ExposedTool,
    error_result,
    parse_arguments,
    tool_result,
    turn_meta,
)

log = logging.getLogger("loopwire.mcp")

RESULT_GRACE_S: Final = 30.0
"""How long past its deadline a turn's result may take (the worker's own cancel path)."""
CANCEL_REASON: Final = "cancelled by the MCP client"


class AgentToolServer:
    """``AgentToolServer(client, tools, metrics=...)``; serve ``.server`` over any MCP transport
    (``worker.cli.mcp`` runs it over stdio or Streamable HTTP)."""

    def __init__(
        self,
        client: LoopwireClient,
        tools: Sequence[ExposedTool],
        *,
        metrics: McpMetrics,
        timeout_s: float = 3600.0,
        remind_every_s: float = 30.0,
        name: str = "loopwire",
    ) -> None:
        self.client = client
        self.tools = {tool.name: tool for tool in tools}
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.remind_every_s = remind_every_s
        self.server: Server[Any] = Server(
            name,
            version=package_version(),
            instructions="Each tool is a loopwire agent: a call runs one turn of it. Pass the "
            "same session_id to continue a conversation.",
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[tool.listing() for tool in self.tools.values()])

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        started = time.monotonic()
        tool = self.tools.get(params.name)
        if tool is None:
            self.metrics.called(params.name, "unknown_tool", time.monotonic() - started)
            raise MCPError(types.INVALID_PARAMS, f"unknown tool: {params.name}")
        arguments = parse_arguments(params.arguments)
        if isinstance(arguments, str):
            self.metrics.called(tool.name, "invalid_arguments", time.monotonic() - started)
            return error_result(arguments)
        handle = await self.client.start_turn(
            tool.name,
            arguments.input,
            session_id=arguments.session_id,
            timeout_s=self.timeout_s,
        )
        outcome: Outcome = "failed"
        in_progress = self.metrics.in_progress.labels(tool.name)
        in_progress.inc()
        try:
            answer, outcome = await self._answer(ctx, tool, handle)
            return answer
        except anyio.get_cancelled_exc_class():
            outcome = "cancelled"
            raise
        finally:
            in_progress.dec()
            self.metrics.called(tool.name, outcome, time.monotonic() - started)
            with anyio.CancelScope(shield=True):  # runs also when the call was cancelled
                await self._end(handle, cancel=outcome in ("cancelled", "timeout", "failed"))

    async def _answer(
        self, ctx: ServerRequestContext[Any], tool: ExposedTool, handle: TurnHandle
    ) -> tuple[types.CallToolResult, Outcome]:
        waiting = self.metrics.waiting.labels(tool.name)
        sent = self.metrics.progress.labels(tool.name)
        progress = TurnProgress(
            ctx.session,
            handle,
            remind_every_s=self.remind_every_s,
            request_id=ctx.request_id,
            on_waiting=lambda now: waiting.inc() if now else waiting.dec(),
            on_sent=sent.inc,
        )
        follow = asyncio.create_task(progress.run())
        try:
            result = await handle.result(self.timeout_s + RESULT_GRACE_S)
        except TurnRejectedError as exc:
            meta = turn_meta(handle.turn_id, handle.request.session_id)
            return error_result(f"The turn was not run: {exc.reason}", meta), "rejected"
        except TimeoutError:
            meta = turn_meta(handle.turn_id, handle.request.session_id)
            text = f"No answer within {self.timeout_s + RESULT_GRACE_S:g} s; the turn is cancelled."
            return error_result(text, meta), "timeout"
        finally:
            follow.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(follow, return_exceptions=True)
        answer = tool_result(tool, result)
        return answer, "not_answered" if answer.is_error else "answered"

    async def _end(self, handle: TurnHandle, *, cancel: bool) -> None:
        try:
            if cancel and not handle.done:
                await handle.cancel(CANCEL_REASON, by="mcp")
            await handle.close()
        except Exception as exc:  # the broker is away: a cancel that is lost leaves the turn
            log.warning("turn %s: could not cancel or close: %r", handle.turn_id, exc)
