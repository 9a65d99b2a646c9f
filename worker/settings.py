"""Worker configuration: environment variables with the ``LOOPWIRE_`` prefix, nested with ``__``.

Example: ``LOOPWIRE_MODEL__BASE_URL=http://localhost:11434/v1``,
``LOOPWIRE_PREFETCH=32``. Every timeout is bounded; nothing waits forever.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator

from contracts import tenancy
from contracts.messages import Usage
from contracts.runtime.connection import ConnectionSettings
from contracts.runtime.event_loop import EventLoop
from contracts.runtime.loading import SettingsError, load
from contracts.turns import Budget
from worker.errors import ConfigError


class ModelSettings(BaseModel):
    base_url: str = Field(
        default="http://127.0.0.1:8099/v1", description="OpenAI-compatible endpoint."
    )
    api_key: SecretStr = Field(
        default=SecretStr("not-needed"), description="API key for the endpoint."
    )
    model: str = Field(
        default="scripted-model", description="Default model; agent profiles may override."
    )
    timeout_s: float = Field(
        default=120.0, gt=0, le=3600, description="Timeout of one model HTTP call."
    )
    connect_timeout_s: float = Field(default=10.0, gt=0, le=600)
    max_retries: int = Field(
        default=2,
        ge=0,
        le=10,
        description="The openai client's retries of 5xx and dropped connections (a 429 parks "
        "the turn instead).",
    )
    bad_response_retries: int = Field(
        default=2, ge=0, le=10, description="Retries of a malformed 200 body."
    )
    max_connections: int = Field(default=1000, ge=1, description="HTTP connection pool size.")
    requests_per_minute: int = Field(
        default=0,
        ge=0,
        description="Fleet-wide limit of calls to this endpoint per minute, shared by every "
        "worker through Redis (0: none).",
    )
    tokens_per_minute: int = Field(
        default=0, ge=0, description="Fleet-wide limit of (estimated) tokens per minute (0: none)."
    )


class ModelPrice(BaseModel):
    """What a model costs, in USD per million tokens."""

    input_per_m: float = Field(ge=0)
    output_per_m: float = Field(ge=0)


class ProviderSettings(ModelSettings):
    """A named model endpoint (``LOOPWIRE_PROVIDERS``): a profile names it (``provider``, or
    each entry of ``models``). The key is read from ``api_key_file`` or the environment
    variable ``api_key_env`` (never from a profile); see docs/providers.md."""

    api_key_env: str | None = Field(
        default=None, description="The environment variable holding the API key."
    )
    api_key_file: Path | None = Field(default=None, description="A file holding the API key.")
    prices: dict[str, ModelPrice] = Field(
        default_factory=dict, description="Prices of this provider's models (as LOOPWIRE_PRICES)."
    )

    def key(self, environ: Mapping[str, str]) -> str:
        """The API key: from the file, else the variable, else ``api_key``."""
        if self.api_key_file is not None:
            return self.api_key_file.read_text(encoding="utf-8").strip()
        if self.api_key_env is not None:
            if self.api_key_env not in environ:
                raise ValueError(f"the environment variable {self.api_key_env} is not set")
            return environ[self.api_key_env]
        return self.api_key.get_secret_value()


class MemorySettings(BaseModel):
    database_url: str | None = Field(
        default=None,
        description="The memory service's database: a deleted session's memories are forgotten "
        "there too (none: no memory service).",
    )


class TenantLimits(BaseModel):
    """One tenant's own limits (``LOOPWIRE_TENANTS__LIMITS``)."""

    max_running: int | None = Field(
        default=None, ge=0, description="Its turns running at once (0: no cap)."
    )
    daily_budget: Budget | None = Field(
        default=None, description="What its turns may spend in a day (UTC)."
    )
    requests_per_minute: int | None = Field(
        default=None, ge=0, description="Its model calls per minute, fleet-wide (0: no limit)."
    )
    tokens_per_minute: int | None = Field(
        default=None,
        ge=0,
        description="Its (estimated) model tokens per minute, fleet-wide (0: no limit).",
    )


class TenancySettings(BaseModel):
    """Tenants kept apart (docs/tenants.md); off: one tenant, ``default``, as before."""

    enabled: bool = Field(
        default=False,
        description="Every message belongs to the tenant of its broker-validated user_id; "
        "sessions, keys and events are kept apart per tenant.",
    )
    users: dict[str, str] = Field(
        default_factory=dict,
        description='AMQP user -> tenant (JSON: {"shop-app": "shop"}); a user not listed is '
        "the tenant of its own name.",
    )
    trusted: list[str] = Field(
        default_factory=list,
        description="AMQP users that may act for any tenant named in the x-loopwire-tenant "
        "header (the HTTP gateway); the fleet's workers always may.",
    )
    intake: list[str] | None = Field(
        default=None,
        description="Tenants given an intake queue of their own (JSON list), so that no other "
        "tenant's backlog delays their turns; unset: each tenant named in users. The others "
        "share loopwire.turns.",
    )
    max_running: int = Field(
        default=0,
        ge=0,
        description="Each tenant's turns running at once (0: no cap); the excess waits in "
        "line, holding no worker, and starts in order as the tenant's turns end.",
    )
    daily_budget: Budget = Field(
        default_factory=Budget,
        description='What each tenant\'s turns may spend in a day, UTC (JSON: {"max_cost_usd": '
        '20, "max_total_tokens": 2000000}); spent, a turn makes one last model call without '
        "tools and ends with finish_reason budget (stopped_by tenant_day.<limit>).",
    )
    requests_per_minute: int = Field(
        default=0,
        ge=0,
        description="Each tenant's model calls per minute, shared by every worker through Redis, "
        "beside the endpoint's limit (0: none); over it, its turns park as throttled.",
    )
    tokens_per_minute: int = Field(
        default=0,
        ge=0,
        description="Each tenant's (estimated) model tokens per minute, as requests_per_minute "
        "(0: none).",
    )
    limits: dict[str, TenantLimits] = Field(
        default_factory=dict,
        description='Limits of one tenant (JSON: {"shop": {"max_running": 5, "daily_budget": '
        '{"max_cost_usd": 50}, "requests_per_minute": 60}}), over the defaults above.',
    )
    metrics_label: bool = Field(
        default=False,
        description="With tenancy on, the turn-level metrics carry a tenant label (capped by "
        "metrics_max_tenants); off, no tenant label at all.",
    )
    metrics_max_tenants: int = Field(
        default=50,
        ge=1,
        le=10_000,
        description="The first this many distinct tenants a worker process sees get a tenant "
        "label of their own; every later one is counted as 'other'.",
    )

    @field_validator("users", "intake")
    @classmethod
    def _tenant_names(cls, value: Any) -> Any:
        names = value.values() if isinstance(value, dict) else value or ()
        bad = [name for name in names if not tenancy.valid(name)]
        if bad:
            raise ValueError(f"not a tenant name: {bad[0][:64]!r} (letters, digits, _ and -)")
        return value


class Settings(ConnectionSettings):
    reconnect_interval_s: float = Field(
        default=1.0, gt=0, le=60, description="Delay between AMQP reconnects."
    )
    redis_timeout_s: float = Field(default=5.0, gt=0, le=60, description="Redis socket timeout.")
    redis_max_connections: int = Field(
        default=200, ge=1, description="Redis connection pool size (per node on a cluster)."
    )
    prefetch: int = Field(
        default=64, ge=1, le=10_000, description="Turn work messages in flight per worker."
    )
    agents_file: Path | None = Field(default=None, description="JSON file with agent profiles.")
    lease_ttl_s: float = Field(
        default=15.0, gt=0, description="Session lease; renewed while a step runs."
    )
    busy_retry_s: float = Field(
        default=0.5, gt=0, description="Delay before retrying work for a busy session."
    )
    max_step_attempts: int = Field(
        default=5, ge=1, description="Failed attempts of a step before it is dead-lettered."
    )
    state_ttl_s: int = Field(
        default=30 * 24 * 3600, ge=60, description="Idle session state lifetime."
    )
    tools_cache_s: float = Field(
        default=1.0, ge=0, description="How long the list of live tools is cached."
    )
    grace_s: float = Field(
        default=25.0, gt=0, description="SIGTERM: time to finish the steps in hand."
    )
    event_loop: EventLoop = Field(
        default="uvloop",
        description="The worker's event loop: uvloop, or the standard asyncio loop.",
    )
    state_format: Literal["json", "msgpack"] = Field(
        default="json",
        description="How session state is written to Redis (both are read): json, or msgpack "
        "as earlier versions wrote it, while workers of those versions still run.",
    )
    history_cache_mb: int = Field(
        default=256,
        ge=0,
        description="Memory a worker may hold in copies of the long session histories it works "
        "on, so a step reads and encodes only what was appended since (0: off).",
    )
    history_cache_min_kb: int = Field(
        default=64,
        ge=0,
        description="The stored size from which a session's history is copied.",
    )
    heap_trim_s: float = Field(
        default=1.0,
        ge=0,
        description="Give the C heap's free pages back to the OS this often while work runs "
        "(glibc's malloc_trim; 0: never).",
    )
    gc_young_threshold: int = Field(
        default=10_000,
        ge=0,
        description="Once started, freeze what startup built out of Python's garbage collector "
        "and collect its young generation every this many allocations (Python's default: 700; "
        "0: Python's defaults).",
    )
    log_level: str = Field(default="INFO", description="Logging level of the worker process.")
    http_port: int = Field(
        default=9464, ge=0, le=65535, description="Port of /metrics, /livez, /readyz (0: off)."
    )
    events: list[str] | None = Field(
        default=None,
        description='The event types published, as fnmatch patterns (JSON: ["turn.*", '
        '"tool.*", "model.*"]); default: every type but model.requested and model.responded; '
        "[]: none.",
    )
    worker_users: list[str] = Field(
        default_factory=list,
        description="The AMQP users of the fleet's workers (JSON list): only a message whose "
        "broker-validated user_id is one of them may deliver a child turn's result or start a "
        "child turn; this worker's own user (from its URL) is always one.",
    )
    stream_interval_s: float = Field(
        default=0.05,
        gt=0,
        le=10,
        description="A streamed answer publishes at most one message.delta per this interval "
        "(the first piece at once, the rest at the end)...",
    )
    stream_max_chars: int = Field(
        default=400,
        ge=1,
        le=100_000,
        description="...unless this many characters piled up before it.",
    )
    model: ModelSettings = ModelSettings()
    memory: MemorySettings = MemorySettings()
    tenants: TenancySettings = TenancySettings()
    providers: dict[str, ProviderSettings] = Field(
        default_factory=dict,
        description="Named model endpoints besides 'default' (LOOPWIRE_MODEL__*), as JSON: "
        '{"backup": {"base_url": "...", "api_key_env": "BACKUP_KEY", "model": "..."}}.',
    )
    prices: dict[str, ModelPrice] = Field(
        default_factory=dict,
        description="Price table for cost budgets and TurnResult.cost_usd, by model name (JSON: "
        '{"gpt-4o-mini": {"input_per_m": 0.15, "output_per_m": 0.6}}); a model not listed '
        "costs 0.",
    )


def load_settings() -> Settings:
    """The settings from the environment, or ``ConfigError`` naming each variable that cannot
    be used (``LOOPWIRE_PREFETCH: input should be a valid integer``)."""
    try:
        return load(Settings)
    except SettingsError as exc:
        raise ConfigError(str(exc)) from None


def price_table(settings: Settings) -> Callable[[str | None, Usage], float]:
    """The cost of one model call's usage, by model (``None``: the default model): the
    providers' price tables and ``LOOPWIRE_PRICES`` (which wins) together."""
    prices = {m: p for provider in settings.providers.values() for m, p in provider.prices.items()}
    prices.update(settings.prices)
    default = settings.model.model

    def price(model: str | None, usage: Usage) -> float:
        found = prices.get(model or default)
        if found is None:
            return 0.0
        return (
            usage.prompt_tokens * found.input_per_m + usage.completion_tokens * found.output_per_m
        ) / 1_000_000

    return price
