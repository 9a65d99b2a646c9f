"""One configured MCP server: its client session, kept up for as long as the bridge runs.

``run()`` (a task of the bridge) starts the session (a child process for stdio, a connection
for Streamable HTTP), lists the tools, then keeps it: the tools are listed again when the
server says its list changed or ``list_ttl_s`` passed, the session is pinged every
``health_interval_s``. A session that fails (the process exits, the connection drops, a ping
or a listing goes unanswered, a call finds the connection closed) is closed and started again
after a delay that doubles from ``restart_min_s`` to ``restart_max_s``. Its tools are withdrawn
as soon as the failure is seen, before the session is closed: closing a stdio child that hangs
takes the SDK's grace (stdin closed, seconds, then SIGTERM and SIGKILL), and a call in that
while must answer ``tool unavailable``, not be sent to a session that is going. The session's
context is entered and left in that one task, as the SDK requires; calls come from other
tasks.

A stdio child gets exactly the environment variables the configuration names: the SDK would
add HOME, PATH and a few more, so the child is started through ``env -u NAME ...``, the
command resolved on the bridge's PATH first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any, cast

import httpx2
import mcp.types as mcp_types
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.stdio import DEFAULT_INHERITED_ENV_VARS
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

from tool_services.mcp.config import ServerConfig
from tool_services.mcp.metrics import McpMetrics
from tool_services.mcp.settings import McpSettings

log = logging.getLogger("loopwire.mcp")

CLIENT_INFO = mcp_types.Implementation(name="loopwire-mcp-bridge", version="1")


class Unavailable(Exception):
    """The server's session is not up: the call was not sent."""


class ConnectionLost(Exception):
    """The session closed while the call was in flight: it may or may not have run."""


class ServerLink:
    """The session of one server; ``on_change`` is called when its tools or its state changed."""

    def __init__(
        self,
        server: ServerConfig,
        settings: McpSettings,
        metrics: McpMetrics,
        on_change: Callable[[ServerLink], None],
    ) -> None:
        self.server = server
        self.settings = settings
        self.metrics = metrics
        self.on_change = on_change
        self.tools: list[mcp_types.Tool] = []
        """The last listing (kept while the server is away: its tools answer unavailable)."""
        self.session: ClientSession | None = None
        self.attempted = asyncio.Event()
        """Set once the first start has succeeded or failed."""
        self._up = asyncio.Event()
        self._wake = asyncio.Event()
        self._relist = False
        self._broken = False

    @property
    def up(self) -> bool:
        return self.session is not None

    async def wait_up(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for the session; True when it is up."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._up.wait()
        return self.session is not None

    async def call(
        self, name: str, arguments: dict[str, Any], *, timeout_s: float, meta: dict[str, Any]
    ) -> mcp_types.CallToolResult:
        """``tools/call``; the SDK sends ``notifications/cancelled`` when ``timeout_s`` passes
        or the caller is cancelled. ``Unavailable``, ``ConnectionLost`` or ``MCPError``."""
        session = self.session
        if session is None:
            raise Unavailable(self.server.name)
        try:
            return await session.call_tool(
                name,
                arguments,
                read_timeout_seconds=timeout_s,
                meta=cast(mcp_types.RequestParamsMeta, meta) if meta else None,
            )
        except MCPError as exc:
            if exc.code == mcp_types.CONNECTION_CLOSED:
                self.broken()
                raise ConnectionLost(self.server.name) from exc
            raise

    def broken(self) -> None:
        """The session is unusable: start it again."""
        self._broken = True
        self._wake.set()

    def list_changed(self) -> None:
        self._relist = True
        self._wake.set()

    # -- the session's task ----------------------------------------------------------------

    async def run(self) -> None:
        delay = self.settings.restart_min_s
        first = True
        while True:
            if not first:
                self.metrics.restarts.labels(self.server.name).inc()
            first = False
            started = time.monotonic()
            try:
                async with AsyncExitStack() as stack:
                    session = await self._connect(stack)
                    await self._list(session, "connect")
                    self._broken = False
                    self._set_session(session)
                    self.attempted.set()
                    log.info(
                        "MCP server %s: connected, %d tool(s)", self.server.name, len(self.tools)
                    )
                    try:
                        await self._keep(session)
                    finally:  # withdrawn now: closing a hung child takes the SDK's seconds
                        self._set_session(None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "MCP server %s: session lost or not started: %s", self.server.name, _why(exc)
                )
            finally:
                self._set_session(None)
                self.attempted.set()
            if time.monotonic() - started > self.settings.restart_max_s:
                delay = self.settings.restart_min_s  # it ran a while: a fresh failure
            log.info("MCP server %s: starting again in %.2gs", self.server.name, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.settings.restart_max_s)

    def _set_session(self, session: ClientSession | None) -> None:
        if (session is None) == (self.session is None):
            return
        self.session = session
        if session is None:
            self._up.clear()
        else:
            self._up.set()
        self.metrics.up.labels(self.server.name).set(0 if session is None else 1)
        self.on_change(self)

    async def _connect(self, stack: AsyncExitStack) -> ClientSession:
        timeout = self.settings.connect_timeout_s
        if self.server.stdio is not None:
            streams = await stack.enter_async_context(stdio_client(self._stdio_parameters()))
        else:
            spec = self.server.http
            assert spec is not None
            client = create_mcp_http_client(
                headers=spec.resolved_headers(), timeout=httpx2.Timeout(timeout, read=300.0)
            )
            await stack.enter_async_context(client)
            streams = await stack.enter_async_context(
                streamable_http_client(spec.url, http_client=client)
            )
        read, write = streams[0], streams[1]
        session = await stack.enter_async_context(
            ClientSession(read, write, message_handler=self._on_message, client_info=CLIENT_INFO)
        )
        async with asyncio.timeout(timeout):
            await session.initialize()
        return session

    def _stdio_parameters(self) -> StdioServerParameters:
        spec = self.server.stdio
        assert spec is not None
        command = shutil.which(spec.command) or spec.command
        env_program = shutil.which("env") or "/usr/bin/env"
        passed = {name: os.environ[name] for name in spec.env if name in os.environ}
        unset = [a for n in DEFAULT_INHERITED_ENV_VARS if n not in passed for a in ("-u", n)]
        return StdioServerParameters(
            command=env_program, args=[*unset, command, *spec.args], env=passed, cwd=spec.cwd
        )

    async def _keep(self, session: ClientSession) -> None:
        """Until the session fails: list again when asked or stale, else ping."""
        interval = self.settings.health_interval_s
        next_list = time.monotonic() + self.server.list_ttl_s
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            self._wake.clear()
            if self._broken:
                raise ConnectionError("a call found the connection closed")
            if self._relist or time.monotonic() >= next_list:
                trigger = "changed" if self._relist else "ttl"
                self._relist = False
                await self._list(session, trigger)
                next_list = time.monotonic() + self.server.list_ttl_s
                self.on_change(self)
            else:
                await self._ping(session)

    async def _ping(self, session: ClientSession) -> None:
        timeout = self.settings.ping_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await session.send_ping()
        except TimeoutError:
            raise ConnectionError(f"no answer to a ping within {timeout:g}s") from None

    async def _list(self, session: ClientSession, trigger: str) -> None:
        tools: list[mcp_types.Tool] = []
        cursor: str | None = None
        async with asyncio.timeout(self.settings.connect_timeout_s):
            while True:
                params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
                page = await session.list_tools(params=params)
                tools.extend(page.tools)
                cursor = page.next_cursor
                if not cursor:
                    break
        self.tools = tools
        self.metrics.refreshes.labels(self.server.name, trigger).inc()
        log.info("MCP server %s: listed %d tool(s) (%s)", self.server.name, len(tools), trigger)

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, mcp_types.ToolListChangedNotification):
            self.list_changed()
        elif isinstance(message, Exception):
            log.debug("MCP server %s: transport fault: %s", self.server.name, message)


def _why(exc: BaseException) -> str:
    """A readable reason, through the SDK's exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
