"""Check a bridge configuration file as the bridge would load it (``loopwire tools mcp-check``,
``python -m tool_services.mcp check FILE [--connect]``).

Without ``--connect``: the file parses and validates, every stdio command is found on PATH,
every working directory exists, every header file is readable. With ``--connect``: each
server is also started (or reached), its tools listed, and what the bridge would serve is
printed, refusals included (they are logged). Exit 0, or 2 with every problem listed.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
from contextlib import AsyncExitStack
from pathlib import Path

from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from tool_services.mcp.config import BridgeConfig, ServerConfig
from tool_services.mcp.link import ServerLink
from tool_services.mcp.metrics import McpMetrics
from tool_services.mcp.names import map_tools
from tool_services.mcp.settings import McpSettings

EXIT_OK = 0
EXIT_INVALID = 2


def problems_of(server: ServerConfig) -> list[str]:
    found: list[str] = []
    if server.stdio is not None:
        if shutil.which(server.stdio.command) is None:
            found.append(f"server {server.name}: command {server.stdio.command!r} not found")
        if server.stdio.cwd is not None and not Path(server.stdio.cwd).is_dir():
            found.append(f"server {server.name}: no directory {server.stdio.cwd!r}")
    if server.http is not None:
        try:
            server.http.resolved_headers()
        except ValueError as exc:
            found.append(f"server {server.name}: {exc}")
    return found


def load(path: Path) -> tuple[BridgeConfig | None, list[str]]:
    try:
        config = BridgeConfig.load(path)
    except ValidationError as exc:
        return None, [
            f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}"
            for e in exc.errors(include_url=False, include_input=False)
        ]
    except (OSError, ValueError) as exc:
        return None, [str(exc)]
    return config, [p for server in config.servers for p in problems_of(server)]


async def list_served(
    config: BridgeConfig, settings: McpSettings | None = None
) -> tuple[dict[str, list[str]], list[str]]:
    """Start each server once and list its tools: server → the names the bridge would serve
    them under, and the servers that could not be started or listed."""
    settings = settings or McpSettings()
    metrics = McpMetrics(CollectorRegistry())
    served: dict[str, list[str]] = {}
    found: list[str] = []
    for server in config.servers:
        link = ServerLink(server, settings, metrics, lambda _link: None)
        try:
            async with AsyncExitStack() as stack:
                session = await link._connect(stack)
                await link._list(session, "connect")
        except Exception as exc:
            found.append(f"server {server.name}: cannot start or list its tools: {exc}")
            continue
        served[server.name] = [m.definition.name for m in map_tools(server, link.tools)]
    return served, found


async def connect_and_list(config: BridgeConfig, settings: McpSettings) -> list[str]:
    served, found = await list_served(config, settings)
    for server, names in served.items():
        sys.stdout.write(f"{server}: serving {', '.join(names) or '-'}\n")
    return found


def run_check(path: Path, *, connect: bool = False) -> int:
    config, found = load(path)
    if config is not None and not found and connect:
        logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(message)s")
        found = asyncio.run(connect_and_list(config, McpSettings()))
    if found:
        sys.stderr.write(f"{path}:\n  - " + "\n  - ".join(found) + "\n")
        return EXIT_INVALID
    assert config is not None
    sys.stdout.write(f"{path}: {len(config.servers)} MCP server(s): ok\n")
    return EXIT_OK
