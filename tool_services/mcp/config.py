"""The bridge's configuration file: which MCP servers it serves, and how (docs/mcp.md).

A JSON file (path from ``LOOPWIRE_MCP__CONFIG``), validated by these models; its JSON Schema
is ``config.schema.json`` beside this module (``python -m tool_services.mcp schema`` writes
it) and ``loopwire tools mcp-check FILE`` checks a file as the bridge would load it::

    {"servers": [
      {"name": "time", "prefix": "time",
       "stdio": {"command": "mcp-server-time", "args": ["--local-timezone", "UTC"],
                 "env": ["TZ"]},
       "idempotent": true},
      {"name": "docs",
       "http": {"url": "https://mcp.example.com/mcp",
                "headers": {"X-Team": "support"},
                "header_files": {"Authorization": "/run/secrets/docs-mcp-authorization"}},
       "deny": ["delete_page"],
       "tools": {"search": {"timeout_s": 10, "idempotent": true}}}
    ]}
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SERVER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
HEADER_NAME_PATTERN = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"
SCHEMA_FILE = Path(__file__).with_name("config.schema.json")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToolOverride(Strict):
    """What the bridge's operator says of one tool, over the server's defaults."""

    idempotent: bool | None = Field(
        default=None,
        description="Run again a call that was in flight when its bridge died (MCP's "
        "idempotentHint is not trusted).",
    )
    timeout_s: float | None = Field(default=None, gt=0, le=3600, description="Time budget.")
    approval: bool | None = Field(
        default=None,
        description="Every call of the tool waits for a human's decision, whichever agent "
        "makes it (announced in the tool's definition; agents may also list it by its prefixed "
        "name under `approval`).",
    )


class StdioSpec(Strict):
    """A server the bridge runs as a child process, speaking MCP on its stdin and stdout."""

    command: str = Field(min_length=1, description="The program (looked up on PATH).")
    args: list[str] = Field(default_factory=list, description="Its arguments.")
    cwd: str | None = Field(default=None, description="Its working directory.")
    env: list[str] = Field(
        default_factory=list,
        description="Names of the bridge's environment variables passed to the child; no "
        "other variable is (not even PATH or HOME unless listed).",
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not re.fullmatch(ENV_NAME_PATTERN, name):
                raise ValueError(f"invalid environment variable name {name!r}")
        return names


class HttpSpec(Strict):
    """A server reached over Streamable HTTP."""

    url: str = Field(pattern=r"^https?://", description="The MCP endpoint.")
    headers: dict[str, str] = Field(
        default_factory=dict, description="Headers sent with every request (not secrets)."
    )
    header_files: dict[str, str] = Field(
        default_factory=dict,
        description="Header name to the path of a file holding its value, less a trailing "
        "newline (secrets, as LOOPWIRE_*_FILE settings are read).",
    )

    @model_validator(mode="after")
    def _header_names(self) -> Self:
        for name in (*self.headers, *self.header_files):
            if not re.fullmatch(HEADER_NAME_PATTERN, name):
                raise ValueError(f"invalid header name {name!r}")
        both = set(self.headers) & set(self.header_files)
        if both:
            raise ValueError(f"headers given both inline and from a file: {sorted(both)}")
        return self

    def resolved_headers(self) -> dict[str, str]:
        """The headers to send, the files read now (``ValueError`` naming an unreadable one)."""
        headers = dict(self.headers)
        for name, path in self.header_files.items():
            try:
                headers[name] = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
            except OSError as exc:
                raise ValueError(f"header {name}: cannot read {path}: {exc.strerror}") from None
        return headers


class ServerConfig(Strict):
    """One MCP server and the tools of it the bridge serves."""

    name: str = Field(pattern=SERVER_NAME_PATTERN, description="The server's name (logs).")
    prefix: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_-]{1,32}$",
        description="Tools are served as <prefix>_<tool> (default: the name).",
    )
    stdio: StdioSpec | None = None
    http: HttpSpec | None = None
    allow: list[str] | None = Field(
        default=None, description="Serve only these of the server's tools (default: all)."
    )
    deny: list[str] = Field(default_factory=list, description="Never serve these tools.")
    idempotent: bool = Field(
        default=False, description="Default of the tools' `idempotent` (see `tools`)."
    )
    timeout_s: float = Field(default=30.0, gt=0, le=3600, description="Default time budget.")
    tools: dict[str, ToolOverride] = Field(
        default_factory=dict, description="Per tool (its MCP name): overrides."
    )
    list_ttl_s: float = Field(
        default=300.0, gt=0, le=86_400, description="List the tools again after this long."
    )

    @model_validator(mode="after")
    def _one_transport(self) -> Self:
        if (self.stdio is None) == (self.http is None):
            raise ValueError(f"server {self.name!r}: give exactly one of stdio and http")
        if self.allow is not None and self.deny:
            raise ValueError(f"server {self.name!r}: give allow or deny, not both")
        return self

    @property
    def tool_prefix(self) -> str:
        return self.prefix or self.name

    def serves(self, tool: str) -> bool:
        """Whether the allow or deny list lets ``tool`` (its MCP name) through."""
        return tool not in self.deny and (self.allow is None or tool in self.allow)

    def idempotent_tool(self, tool: str) -> bool:
        override = self.tools.get(tool)
        if override is not None and override.idempotent is not None:
            return override.idempotent
        return self.idempotent

    def approval_of(self, tool: str) -> bool:
        override = self.tools.get(tool)
        return bool(override is not None and override.approval)

    def timeout_of(self, tool: str) -> float:
        override = self.tools.get(tool)
        if override is not None and override.timeout_s is not None:
            return override.timeout_s
        return self.timeout_s


class BridgeConfig(Strict):
    """The bridge's configuration file."""

    schema_version: Literal[1] = 1
    servers: list[ServerConfig] = Field(description="The MCP servers served.")

    @model_validator(mode="after")
    def _unique(self) -> Self:
        for what, values in (
            ("name", [s.name for s in self.servers]),
            ("prefix", [s.tool_prefix for s in self.servers]),
        ):
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:
                raise ValueError(f"servers share a {what}: {', '.join(twice)}")
        return self

    @classmethod
    def load(cls, path: Path) -> BridgeConfig:
        """The file's configuration; ``ValueError`` (or ``OSError``) saying what is wrong."""
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls.model_validate(data)


def json_schema() -> dict[str, Any]:
    return BridgeConfig.model_json_schema(mode="validation")


def write_schema(path: Path = SCHEMA_FILE) -> None:
    path.write_text(json.dumps(json_schema(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
