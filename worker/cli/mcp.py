"""``loopwire mcp serve``: the agents an agents file marks ``"mcp"`` as MCP tools, over stdio
(the default: an MCP host starts the command) or Streamable HTTP (``--transport http``).

This module is the command's half that knows the worker's agent profiles: it reads the file
(``worker.profiles.agents``, as ``loopwire agents`` does) and hands a plain list of
``ExposedTool`` to the server (``gateway.mcp``), which imports ``contracts`` only and
publishes turns through the publisher client. The file is read once, at start: restart the
command to offer a changed list.

A workflow's output schema is derived from its nodes (``worker.loop.workflow`` plans what its
``output`` is): a sequential one's is its last node's, a loop's its node's, a parallel one's
with a join the join's, a conditional one's its branches' (one of them, ``anyOf`` when they
differ; none when a branch has none), a parallel one's without a join an object with a
property per node (``id``): the node's output, or its text when it gave none (a node of no
known shape: any value). A node's own schema counts only when its ``type`` excludes strings:
a node's value that is a string is its text, not its output (``workflow.answer_of``), so a
schema that allows one could not be kept. Anything else lists no schema, and the workflow
answers with text.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry

from contracts.client import LoopwireClient
from contracts.runtime.health import HealthServer
from contracts.runtime.metrics import build_info
from contracts.runtime.tls import TlsFiles
from gateway.mcp import AgentToolServer, ExposedTool, McpMetrics
from worker.cli.turns import connect
from worker.errors import CliError
from worker.loop.workflow import Workflow
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
        tools.append(
            ExposedTool(
                name=agent.name,
                description=agent.mcp.description or agent.description,
                output_schema=output_schema_of(profiles, agent.name),
            )
        )
    if not tools:
        raise CliError(f'agents file {path}: no agent or workflow is marked "mcp"', code=2)
    return tools


def output_schema_of(profiles: AgentProfiles, name: str) -> dict[str, Any] | None:
    """The schema of the agent's or workflow's structured output, when it is known."""
    profile = profiles.get(name)
    assert profile is not None  # the file was checked when it loaded
    if profile.workflow is not None:
        return _workflow_schema(profiles, profile.workflow)
    return profile.output_schema


def _workflow_schema(profiles: AgentProfiles, flow: Workflow) -> dict[str, Any] | None:
    if flow.kind == "sequential":
        return _node_schema(profiles, flow.nodes[-1].run)
    if flow.kind == "parallel":
        if flow.join is not None:
            return _node_schema(profiles, flow.join.run)
        return {
            "type": "object",
            "properties": {n.key: _node_value_schema(profiles, n.run) for n in flow.nodes},
            "required": [n.key for n in flow.nodes],
            "additionalProperties": False,
        }
    assert flow.node is not None
    if flow.kind == "loop":
        return _node_schema(profiles, flow.node.run)
    branches = [*flow.routes.values(), *([flow.default] if flow.default else [])]
    schemas = [_node_schema(profiles, branch.run) for branch in branches]
    if not schemas or any(schema is None for schema in schemas):
        return None
    distinct = list({json.dumps(schema, sort_keys=True): schema for schema in schemas}.values())
    return distinct[0] if len(distinct) == 1 else {"anyOf": distinct}


def _node_schema(profiles: AgentProfiles, run: str) -> dict[str, Any] | None:
    """The schema of a node's output as the workflow keeps it (never a string)."""
    schema = output_schema_of(profiles, run)
    if schema is None:
        return None
    kind = schema.get("type")
    types = kind if isinstance(kind, list) else [kind]
    return schema if kind is not None and "string" not in types else None


def _node_value_schema(profiles: AgentProfiles, run: str) -> dict[str, Any]:
    """A parallel node's value without a join: its output, else its text."""
    schema = _node_schema(profiles, run)
    if schema is not None:
        return {"anyOf": [schema, {"type": "string"}]}
    profile = profiles.get(run)
    return {"type": "string"} if profile is not None and profile.workflow is None else {}


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
