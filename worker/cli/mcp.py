"""``loopwire mcp serve``: the agents an agents file marks ``"mcp"`` as MCP tools, over stdio
(the default: an MCP host starts the command) or Streamable HTTP (``--transport http``).

This module is the command's half that knows the worker's agent profiles: it reads the file
(``worker.profiles.agents``, as ``loopwire agents`` does) and hands a plain list of
``ExposedTool`` to the server (``gateway.mcp``), which imports ``contracts`` only and
publishes turns through the publisher client. The file is read once, at start: restart the
command to offer a changed list.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

from prometheus_client import CollectorRegistry

from contracts.client import LoopwireClient
from contracts.runtime.health import HealthServer
from contracts.runtime.metrics import build_info
from contracts.runtime.tls import TlsFiles
from gateway.mcp import AgentToolServer, ExposedTool, McpMetrics
from worker.cli.turns import connect
from worker.errors import CliError
from worker.profiles.agents import AgentProfiles

log = logging.getLogger("loopwire.mcp")

Transport = Literal["stdio", "http"]


def exposed_tools(path: Path) -> list[ExposedTool]:
    """The agents and workflows of the file marked ``"mcp"``, as tools."""
    try:
        profiles = AgentProfiles.load(path)
    except (OSError, ValueError) as exc:  # ValidationError and JSONDecodeError are ValueErrors
        raise CliError(f"agents file {path}: {exc}", code=2) from None
    tools = []
    for agent in profiles.agents:
        if agent.mcp is None:
            continue
        structured = agent.output_schema if agent.workflow is None else None
        tools.append(
            ExposedTool(
                name=agent.name,
                description=agent.mcp.description or agent.description,
                output_schema=structured,
            )
        )
    if not tools:
        raise CliError(f'agents file {path}: no agent or workflow is marked "mcp"', code=2)
    return tools


async def run_mcp_serve(
    *,
    amqp_url: str,
    tls: TlsFiles | None,
    agents_file: Path | None,
    transport: Transport,
    host: str,
    port: int,
    path: str,
    timeout_s: float,
    remind_every_s: float,
    metrics_port: int | None,
    tenant: str | None = None,
) -> int:
    if agents_file is None:
        raise CliError("no agents file: give --agents-file or set LOOPWIRE_AGENTS_FILE", code=2)
    tools = exposed_tools(agents_file)
    registry = CollectorRegistry()
    build_info(registry, component="mcp", service="mcp")
    metrics = McpMetrics(registry, tools=(t.name for t in tools))
    async with (
        connect(amqp_url, tls, tenant) as client,
        _health(client, registry, metrics_port),
    ):
        server = AgentToolServer(
            client, tools, metrics=metrics, timeout_s=timeout_s, remind_every_s=remind_every_s
        )
        names = ", ".join(t.name for t in tools)
        if transport == "stdio":
            log.info("serving %s over stdio", names)
            await _stdio(server)
        else:
            log.info("serving %s on http://%s:%d%s", names, host, port, path)
            await _http(server, host=host, port=port, path=path)
    return 0


async def _stdio(server: AgentToolServer) -> None:
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read, write):
        await server.server.run(read, write, server.server.create_initialization_options())


async def _http(server: AgentToolServer, *, host: str, port: int, path: str) -> None:
    import uvicorn

    app = server.server.streamable_http_app(streamable_http_path=path, host=host)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    await uvicorn.Server(config).serve()


@contextlib.asynccontextmanager
async def _health(
    client: LoopwireClient, registry: CollectorRegistry, port: int | None
) -> AsyncIterator[None]:
    """``/metrics``, ``/livez``, ``/readyz`` (ready while the broker connection is open)."""
    if port is None:
        yield
        return

    async def connected() -> bool:
        return not client.channel.is_closed

    health = HealthServer(registry=registry, checks={"amqp": connected}, port=port)
    await health.start()
    try:
        yield
    finally:
        await health.stop()


def configure_logging(level: str) -> None:
    """Log lines on stderr (stdout is the MCP stream over stdio)."""
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
