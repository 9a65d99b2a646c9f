"""An MCP server for the bridge's tests, built with the official ``mcp`` SDK.

``python -m tests.mcp_fixtures.server stdio`` or ``... http PORT`` (Streamable HTTP on
127.0.0.1:PORT, path ``/mcp``). With ``MCP_FIXTURE_LOG`` set, each tool appends a line there
as it starts and ends (``start slow <id>``, ``end slow <id>``, ``cancelled slow <id>``), so a
test can see what ran, and how often, without sleeping (``slow`` and ``freeze`` log their pid
too). While the file ``MCP_FIXTURE_REFUSE_FILE`` names exists, the server exits at once instead
of starting.

Two tools change the server itself: ``freeze`` blocks its event loop for good (a server that
hangs: the process lives, nothing is answered, not even a ping), and ``reshape`` adds the tool
``extra`` and removes ``fail`` without telling the client (no ``notifications/tools/
list_changed``: only a client that lists again sees it).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ImageContent
from pydantic import BaseModel


class Sum(BaseModel):
    total: int
    terms: list[int]


def _log(line: str) -> None:
    path = os.environ.get("MCP_FIXTURE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(line + "\n")


def build() -> MCPServer:
    server: MCPServer = MCPServer("fixture", log_level="WARNING")

    @server.tool(description="Add integers; a structured result.")
    def add(terms: list[int]) -> Sum:
        _log("start add")
        return Sum(total=sum(terms), terms=terms)

    @server.tool(description="Echo the text back (logs the traceparent of the call's _meta).")
    def echo(text: str, ctx: Context) -> str:
        meta = ctx.request_context.meta or {}
        _log(f"start echo {text} {meta.get('traceparent', '-')}")
        return text

    @server.tool(description="Always fails with the given message.")
    def fail(message: str) -> str:
        raise ToolError(message)

    @server.tool(description="Sleep, then answer; logs its start, end or cancellation.")
    async def slow(seconds: float, tag: str = "") -> str:
        _log(f"start slow {tag} {os.getpid()}")
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            _log(f"cancelled slow {tag}")
            raise
        _log(f"end slow {tag}")
        return f"slept {seconds}s"

    @server.tool(description="An image and a resource link, no text.", structured_output=False)
    def picture() -> list[Any]:
        return [ImageContent(type="image", data="iVBORw0KGgo=", mime_type="image/png")]

    @server.tool(description="The value of an environment variable, or null.")
    def getenv(name: str) -> dict[str, str | None]:
        return {"value": os.environ.get(name)}

    @server.tool(description="Add the tool 'extra' and tell the client the list changed.")
    async def grow(ctx: Context) -> str:
        if "extra" not in {t.name for t in await server.list_tools()}:
            server.add_tool(_extra, name="extra", description="Appears at run time.")
        await ctx.session.send_tool_list_changed()
        return "grown"

    _add_changing(server)
    return server


def _add_changing(server: MCPServer) -> None:
    """The tools that change the server itself."""

    @server.tool(description="Hang the whole server: its event loop blocks for good.")
    async def freeze() -> str:
        _log(f"start freeze {os.getpid()}")
        while True:
            time.sleep(3600)  # blocks the loop: no request, no ping is answered any more

    @server.tool(description="Add 'extra' and remove 'fail', without telling the client.")
    async def reshape() -> str:
        if "extra" not in {t.name for t in await server.list_tools()}:
            server.add_tool(_extra, name="extra", description="Appears at run time.")
            server.remove_tool("fail")
        _log("start reshape")
        return "reshaped"


def _extra() -> str:
    return "extra ran"


def main(argv: list[str]) -> None:
    refuse = os.environ.get("MCP_FIXTURE_REFUSE_FILE")
    if refuse and os.path.exists(refuse):  # a server that cannot start (until the file goes)
        sys.exit(1)
    server = build()
    if argv[:1] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(argv[1]))
    else:
        server.run("stdio")


if __name__ == "__main__":
    main(sys.argv[1:])
