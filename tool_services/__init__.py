"""Tool services: declare tools as typed async functions and serve them over RabbitMQ.

See ``tool_services.sdk`` for declaring tools, ``tool_services.runner`` for
running a service, and ``tool_services.registry.live_tools`` for the workers'
view of which tools are available. Importing this package connects to nothing.
"""

from tool_services.sdk import (
    CallContext,
    OutcomeUnknown,
    Tool,
    ToolError,
    ToolResult,
    ToolService,
)

__all__ = ["CallContext", "OutcomeUnknown", "Tool", "ToolError", "ToolResult", "ToolService"]
