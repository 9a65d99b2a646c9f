"""loopwire agents as MCP tools: ``loopwire mcp serve`` (docs/mcp.md, "Agents as MCP tools").

The MCP server is a front door like the HTTP gateway: it publishes turns through the publisher
client and reads nothing of a worker, so it lives under ``gateway/`` and imports ``contracts``
only. Which agents it offers comes as a plain list of ``ExposedTool`` from whoever starts it
(the ``loopwire`` command reads them from the agents file, ``worker.cli.mcp``)."""

from gateway.mcp.metrics import McpMetrics
from gateway.mcp.server import AgentToolServer
from gateway.mcp.tools import ExposedTool

__all__ = ["AgentToolServer", "ExposedTool", "McpMetrics"]
