"""The bridge as a tool service: every configured MCP server's tools, served and announced
like any SDK tool (``ToolService(dynamic=True)`` over ``tool_services.server``).

The served set is rebuilt whenever a server's session comes or goes or its tools were
listed: a tool of a server that is up is offered (announced at once); a tool whose server is
away, or that its server no longer lists, stays served but is no longer offered, and its
calls answer ``tool unavailable`` (a call may still be on its way, or in its queue).

A call becomes ``tools/call`` with the call's remaining time (at most the tool's
``timeout_s``) as the MCP request's timeout; cancelling it (the time budget, a shutdown)
makes the SDK send ``notifications/cancelled``. The trace context travels in ``_meta``
(``traceparent``). Replies are stored by idempotency key by the SDK's server, as for every
tool service. A session lost mid-call: an ``idempotent`` tool (by the bridge's
configuration) is sent again once the session is back, within the call's time; any other
answers ``unknown`` (it may or may not have taken effect).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from mcp.shared.exceptions import MCPError
from mcp_types import REQUEST_TIMEOUT
from prometheus_client import CollectorRegistry
from pydantic import RootModel

from contracts.runtime.tracing import inject
from tool_services.mcp.config import BridgeConfig
from tool_services.mcp.link import ConnectionLost, ServerLink, Unavailable
from tool_services.mcp.metrics import McpMetrics
from tool_services.mcp.names import Mapped, map_tools
from tool_services.mcp.results import value_of
from tool_services.mcp.settings import McpSettings
from tool_services.sdk import CallContext, OutcomeUnknown, Tool, ToolError, ToolService

log = logging.getLogger("loopwire.mcp")

ToolFn = Callable[[Any, CallContext], Awaitable[Any]]


class McpArguments(RootModel[dict[str, Any]]):
    """The call's arguments as they came: the MCP server validates them."""


class McpBridge:
    """Builds the ``ToolService`` and runs the servers' sessions while it is served."""

    def __init__(self, config: BridgeConfig, settings: McpSettings, *, name: str = "mcp") -> None:
        self.config = config
        self.settings = settings
        self.service = ToolService(name, dynamic=True)
        self.service.on_startup(self._start)
        self.service.on_shutdown(self._stop)
        self.links: list[ServerLink] = []
        self._mapped: dict[str, list[Mapped]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics: McpMetrics | None = None

    async def _start(self, registry: CollectorRegistry) -> None:
        self.metrics = McpMetrics(registry, [s.name for s in self.config.servers])
        self.links = [
            ServerLink(server, self.settings, self.metrics, self._changed)
            for server in self.config.servers
        ]
        for link in self.links:
            self._tasks.append(asyncio.create_task(link.run(), name=f"mcp:{link.server.name}"))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.start_wait_s):
                await asyncio.gather(*(link.attempted.wait() for link in self.links))
        for link in self.links:
            if not link.up:
                log.warning(
                    "MCP server %s is not up yet; its tools come when it is", link.server.name
                )

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def _changed(self, link: ServerLink) -> None:
        """A server's session came or went, or its tools were listed: rebuild the tools."""
        self._mapped[link.server.name] = map_tools(link.server, link.tools)
        tools: dict[str, Tool] = {
            name: _withdrawn(tool, "its MCP server no longer offers it")
            for name, tool in self.service.tools.items()
        }
        for each in self.links:
            mapped = self._mapped.get(each.server.name, [])
            for m in mapped:
                tools[m.definition.name] = Tool(
                    definition=m.definition,
                    args_model=McpArguments,
                    fn=self._caller(each, m),
                    offered=each.up,
                )
            if self.metrics is not None:
                self.metrics.tools.labels(each.server.name).set(len(mapped) if each.up else 0)
        self.service.replace_tools(tools.values())

    def _caller(self, link: ServerLink, mapped: Mapped) -> ToolFn:
        async def call(args: McpArguments, ctx: CallContext) -> Any:
            return await self._call(link, mapped, args.root, ctx)

        return call

    async def _call(
        self, link: ServerLink, mapped: Mapped, arguments: dict[str, Any], ctx: CallContext
    ) -> Any:
        server = link.server.name
        metrics = self.metrics
        assert metrics is not None
        meta: dict[str, Any] = {}
        inject(meta)
        attempts = 2 if mapped.definition.idempotent else 1
        for attempt in range(attempts):
            timeout = min(mapped.definition.timeout_s, ctx.remaining_s())
            if attempt and not await link.wait_up(max(0.0, timeout)):
                break
            try:
                result = await link.call(mapped.mcp_name, arguments, timeout_s=timeout, meta=meta)
            except Unavailable:
                metrics.calls.labels(server, "unavailable").inc()
                raise ToolError(
                    f"tool unavailable: the MCP server {server!r} is not connected"
                ) from None
            except ConnectionLost:
                metrics.calls.labels(server, "connection_lost").inc()
                log.warning(
                    "MCP server %s went away during call %s of %s%s",
                    server,
                    ctx.call_id,
                    mapped.definition.name,
                    "; calling again once it is back" if attempt + 1 < attempts else "",
                )
                continue
            except MCPError as exc:
                if exc.code == REQUEST_TIMEOUT:
                    metrics.calls.labels(server, "timeout").inc()
                    raise ToolError(f"timed out after {timeout:.3g}s") from None
                metrics.calls.labels(server, "protocol_error").inc()
                raise ToolError(f"MCP error {exc.code}: {exc.message}") from None
            try:
                value = value_of(result)
            except ToolError:
                metrics.calls.labels(server, "tool_error").inc()
                raise
            metrics.calls.labels(server, "ok").inc()
            return value
        if mapped.definition.idempotent:
            raise ToolError(
                f"tool unavailable: the MCP server {server!r} went away during the call "
                "and did not come back in time"
            )
        raise OutcomeUnknown(
            f"the MCP server {server!r} went away during the call of {mapped.definition.name!r}; "
            "it may or may not have taken effect, and the tool is not marked idempotent, so it "
            "was not called again"
        )


def _withdrawn(tool: Tool, why: str) -> Tool:
    """``tool`` served but not offered: its calls answer ``tool unavailable``."""

    async def unavailable(args: Any, ctx: CallContext) -> Any:
        raise ToolError(f"tool unavailable: {why}")

    return Tool(
        definition=tool.definition, args_model=tool.args_model, fn=unavailable, offered=False
    )
