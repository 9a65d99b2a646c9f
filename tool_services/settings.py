"""Tool service configuration: environment variables with the ``LOOPWIRE_`` prefix, nested with ``__``.

Examples: ``LOOPWIRE_AMQP_URL=amqp://user:pass@rabbit:5672/``,
``LOOPWIRE_TOOLS__CONCURRENCY=32``, ``LOOPWIRE_TOOLS__GRACE_S=30``,
``LOOPWIRE_TOOLS__HTTP_PORT=9465`` (serve ``/metrics``, ``/livez``, ``/readyz``).
"""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, Field, model_validator

from contracts.runtime.connection import ConnectionSettings


class ToolServiceSettings(BaseModel):
    """The ``tools`` group: how one tool service instance runs."""

    concurrency: int = Field(
        default=16, ge=1, le=10_000, description="Tool calls executing at once (and prefetch)."
    )
    announce_interval_s: float = Field(
        default=5.0, gt=0, le=300, description="How often the instance re-announces its tools."
    )
    announce_ttl_s: float = Field(
        default=45.0,
        gt=0,
        le=3600,
        description="An announcement not refreshed for this long is dead. An outage of Redis or "
        "the broker shorter than announce_ttl_s - announce_interval_s removes no live tool; a "
        "service that died without withdrawing stays offered this long.",
    )
    reconnect_interval_s: float = Field(
        default=1.0, gt=0, le=60, description="Delay between AMQP reconnects (as the worker's)."
    )
    grace_s: float = Field(
        default=20.0, ge=0, le=3600, description="On SIGTERM, how long in-flight calls may finish."
    )
    idempotency_ttl_s: int = Field(
        default=86_400, ge=1, description="How long a call's stored reply answers duplicates."
    )
    lease_ms: int = Field(
        default=3000, ge=100, le=600_000, description="Lease of a running call; gone = owner died."
    )
    lease_refresh_s: float = Field(
        default=1.0, gt=0, description="How often the owner of a running call renews its lease."
    )
    duplicate_poll_s: float = Field(
        default=0.05, gt=0, le=10, description="How often a duplicate polls for the stored reply."
    )
    http_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Port of /metrics, /livez, /readyz (0: off; the container image sets 9465).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.announce_ttl_s <= self.announce_interval_s:
            raise ValueError("announce_ttl_s must be longer than announce_interval_s")
        if self.lease_refresh_s * 1000 >= self.lease_ms:
            raise ValueError("lease_refresh_s must be shorter than lease_ms")
        return self


class Settings(ConnectionSettings):
    log_level: str = Field(default="INFO", description="Logging level of `serve`.")
    tools: ToolServiceSettings = Field(default_factory=ToolServiceSettings)
