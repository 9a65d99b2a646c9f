"""An MCP ``tools/call`` result as the model reads it.

- ``structuredContent`` present: it is the value.
- else the text content, joined by blank lines, is the value (a string).
- content that is not text (images, audio, resources, resource links) is described in a line
  of its own (``[image: image/png, 3.2 kB, not shown]``), never dropped silently; with
  ``structuredContent`` those lines are the value's ``content_not_shown`` list only when the
  structured value is an object.
- ``isError``: the text (and descriptions) becomes the error the model reads.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import mcp.types as mcp_types

from tool_services.sdk import ToolError


def value_of(result: mcp_types.CallToolResult) -> Any:
    """The tool's value; ``ToolError`` with the server's message when ``isError``."""
    texts: list[str] = []
    others: list[str] = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            texts.append(block.text)
        else:
            others.append(describe(block))
    if result.is_error:
        raise ToolError("\n\n".join(texts + others) or "the MCP tool reported an error")
    if result.structured_content is not None:
        value = result.structured_content
        if others and isinstance(value, dict):
            return {**value, "content_not_shown": others}
        return value
    return "\n\n".join(texts + others)


def describe(block: Any) -> str:
    """One line saying what a content block that is not text was."""
    if isinstance(block, mcp_types.ImageContent | mcp_types.AudioContent):
        kind = "image" if isinstance(block, mcp_types.ImageContent) else "audio"
        return f"[{kind}: {block.mime_type}, {_size(block.data)}, not shown]"
    if isinstance(block, mcp_types.ResourceLink):
        return f"[resource link: {block.uri}{_mime(block.mime_type)}, not fetched]"
    if isinstance(block, mcp_types.EmbeddedResource):
        resource = block.resource
        if isinstance(resource, mcp_types.TextResourceContents):
            return f"[resource {resource.uri}{_mime(resource.mime_type)}]\n{resource.text}"
        size = _size(getattr(resource, "blob", ""))
        return f"[resource {resource.uri}{_mime(resource.mime_type)}: binary, {size}, not shown]"
    kind = getattr(block, "type", type(block).__name__)
    return f"[{kind} content, not shown]"


def _mime(mime: str | None) -> str:
    return f" ({mime})" if mime else ""


def _size(data: str) -> str:
    try:
        n = len(base64.b64decode(data, validate=False))
    except (binascii.Error, ValueError):
        n = len(data)
    return f"{n} bytes" if n < 1024 else f"{n / 1024:.1f} kB"
