"""The bridge's settings: the tool services' own (``LOOPWIRE_AMQP_URL``, ``LOOPWIRE_TOOLS__*``)
plus the ``mcp`` group, ``LOOPWIRE_MCP__CONFIG`` (the configuration file) and timings."""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import BaseModel, Field, model_validator

from tool_services.settings import Settings


class McpSettings(BaseModel):
    config: Path | None = Field(default=None, description="The configuration file (JSON).")
    service: str = Field(
        default="mcp",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="The service name it announces (one per bridge deployment).",
    )
    connect_timeout_s: float = Field(
        default=15.0, gt=0, le=600, description="Starting a server and its MCP handshake."
    )
    start_wait_s: float = Field(
        default=10.0,
        ge=0,
        le=600,
        description="At start, how long to wait for the servers' first tool lists before "
        "serving (a server that comes up later adds its tools then).",
    )
    health_interval_s: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="A session is pinged this often (calls in flight or not); the tool list's "
        "list_ttl_s is checked as often.",
    )
    ping_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="A server that does not answer a ping within this long is taken for hung: "
        "its tools are withdrawn and it is restarted or reconnected (a busy machine answers "
        "late; a dead process is noticed at once anyway).",
    )
    restart_min_s: float = Field(default=0.5, gt=0, le=60, description="First restart delay.")
    restart_max_s: float = Field(
        default=30.0, gt=0, le=3600, description="Restart delays double up to this."
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.restart_max_s < self.restart_min_s:
            raise ValueError("restart_max_s must not be shorter than restart_min_s")
        return self


class BridgeSettings(Settings):
    mcp: McpSettings = Field(default_factory=McpSettings)
