"""An MCP server for the bridge's tests, built with the ``mcp`` SDK (``server.py``)."""
