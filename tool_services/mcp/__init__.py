"""The MCP bridge: tools of Model Context Protocol servers served as a tool service
(``python -m tool_services.mcp``, ``loopwire tools serve mcp``; docs/mcp.md).

``create_service()`` reads ``LOOPWIRE_MCP__CONFIG`` (``tool_services.mcp.config``) and
returns the dynamic ``ToolService`` of ``tool_services.mcp.bridge``; nothing starts until
the service is served.
"""

from __future__ import annotations

from tool_services.mcp.bridge import McpBridge
from tool_services.mcp.config import BridgeConfig
from tool_services.mcp.settings import BridgeSettings
from tool_services.runner import StartError
from tool_services.sdk import ToolService

__all__ = ["McpBridge", "create_service"]


def create_service() -> ToolService:
    settings = BridgeSettings().mcp
    if settings.config is None:
        raise StartError("the MCP bridge needs LOOPWIRE_MCP__CONFIG (its configuration file)")
    try:
        config = BridgeConfig.load(settings.config)
    except (OSError, ValueError) as exc:
        raise StartError(f"MCP bridge configuration {settings.config}: {exc}") from None
    return McpBridge(config, settings, name=settings.service).service
