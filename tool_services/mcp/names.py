"""Which of an MCP server's tools the bridge serves, under which names and schemas.

A tool ``t`` of a server with prefix ``p`` is served as ``p_t``; ``.`` and ``/`` in ``t``
become ``_`` (``files/read`` → ``p_files_read``). A name that still breaks the tool-name rule
(letters, digits, ``_`` and ``-``, at most 64 characters), or that two tools would share, is
refused, as is a tool whose ``inputSchema`` is not a valid JSON Schema of an object; each
refusal is logged with the tool's name, and the server's other tools are served.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jsonschema
import mcp.types as mcp_types
from jsonschema.exceptions import SchemaError

from contracts.base import TOOL_NAME_PATTERN
from contracts.tools import ToolDefinition
from tool_services.mcp.config import ServerConfig

log = logging.getLogger("loopwire.mcp")

MAX_DESCRIPTION = 8000


@dataclass(frozen=True, slots=True)
class Mapped:
    """One MCP tool as the bridge serves it."""

    mcp_name: str
    definition: ToolDefinition


def served_name(prefix: str, mcp_name: str) -> str | None:
    """``<prefix>_<tool>``, or None when that cannot be a tool name."""
    name = f"{prefix}_{re.sub(r'[./]', '_', mcp_name)}"
    return name if re.fullmatch(TOOL_NAME_PATTERN, name) else None


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` cannot be a tool's parameters (None: it can)."""
    if not isinstance(schema, dict):
        return "its inputSchema is not an object"
    if schema.get("type") != "object":
        return "its inputSchema does not describe an object (type is not 'object')"
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        return f"its inputSchema is not a valid JSON Schema: {exc.message}"
    return None


def map_tools(server: ServerConfig, tools: Iterable[mcp_types.Tool]) -> list[Mapped]:
    """The server's tools the bridge serves (allowed, mappable, with a valid schema)."""
    mapped: dict[str, Mapped] = {}
    taken: set[str] = set()
    for tool in tools:
        if not server.serves(tool.name):
            continue
        name = served_name(server.tool_prefix, tool.name)
        problem = schema_problem(tool.input_schema)
        if name is None:
            problem = f"'{server.tool_prefix}_{tool.name}' breaks the tool-name rule ({TOOL_NAME_PATTERN})"
        elif name in taken:
            problem = f"another tool of the server is also served as {name!r}"
        if problem is not None:
            log.error("MCP server %s: tool %r refused: %s", server.name, tool.name, problem)
            mapped.pop(name or "", None)
            continue
        assert name is not None
        taken.add(name)
        description = tool.description or tool.title or ""
        mapped[name] = Mapped(
            mcp_name=tool.name,
            definition=ToolDefinition(
                name=name,
                description=description[:MAX_DESCRIPTION],
                parameters=dict(tool.input_schema),
                timeout_s=server.timeout_of(tool.name),
                idempotent=server.idempotent_tool(tool.name),
                approval=server.approval_of(tool.name),
            ),
        )
    return list(mapped.values())
