"""The HTTP gateway's settings (``LOOPWIRE_GATEWAY__*``, beside the connection settings every
loopwire process reads; docs/http.md)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, SecretStr

from contracts.runtime.connection import ConnectionSettings
from contracts.runtime.event_loop import EventLoop


class GatewayOptions(BaseModel):
    host: str = Field(default="127.0.0.1", description="Address the HTTP server listens on.")
    port: int = Field(default=8123, ge=1, le=65535, description="Its port.")
    keys_file: Path | None = Field(
        default=None,
        description="The API keys file (JSON: hashed keys, each with its tenant); required.",
    )
    agents_file: Path | None = Field(
        default=None,
        description="The agents file the workers run (LOOPWIRE_AGENTS_FILE when unset): the "
        "assistants offered.",
    )
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, le=64 * 1_048_576, description="Largest request body."
    )
    wait_timeout_s: float = Field(
        default=600.0, gt=0, le=86_400, description="How long /runs/wait and join wait."
    )
    webhook_secret: SecretStr | None = Field(
        default=None,
        description="The Standard Webhooks signing secret (whsec_<base64>); unset: runs with a "
        "webhook are refused.",
    )
    webhook_allow: list[str] = Field(
        default_factory=list,
        description="Hosts and networks (JSON list: names, addresses, CIDRs) a webhook may "
        "name although internal (private, loopback, link-local).",
    )
    console: bool = Field(
        default=True, description="Serve the operator console at /console (docs/console.md)."
    )
    console_list_size: int = Field(
        default=1000, ge=10, le=10_000, description="Turns the console's live list shows."
    )
    trace_url: str | None = Field(
        default=None,
        description="A trace's address in the tracing UI, with {trace_id} (e.g. "
        "http://jaeger:16686/trace/{trace_id}): the console links each turn to its trace.",
    )
    webhook_attempts: int = Field(default=8, ge=1, le=50, description="Tries of a webhook.")
    webhook_timeout_s: float = Field(default=10.0, gt=0, le=300, description="Each try's time.")


class GatewaySettings(ConnectionSettings):
    gateway: GatewayOptions = Field(default_factory=GatewayOptions)
    agents_file: Path | None = Field(default=None, description="The workers' agents file.")
    state_ttl_s: int = Field(
        default=7 * 24 * 3600,
        gt=0,
        description="A thread's idle lifetime, as the workers' sessions (LOOPWIRE_STATE_TTL_S).",
    )
    event_loop: EventLoop = Field(
        default="uvloop",
        description="The gateway's event loop: uvloop, or the standard asyncio loop.",
    )
