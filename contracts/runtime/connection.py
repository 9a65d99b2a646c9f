"""Where a process finds RabbitMQ and Redis, and how it speaks to them: the settings the
workers and the tool services share (``worker.settings``, ``tool_services.settings``)."""

from __future__ import annotations

from pydantic import Field, field_validator

from contracts.runtime import amqp, redis_client
from contracts.runtime.secrets import LoopwireSettings
from contracts.runtime.tls import TlsFiles


class ConnectionSettings(LoopwireSettings):
    """``LOOPWIRE_AMQP_URL(S)``, ``LOOPWIRE_REDIS_URL``, ``LOOPWIRE_REDIS_CLUSTER`` and the TLS
    files of both (docs/operations.md)."""

    amqp_url: str = Field(default="amqp://guest:guest@127.0.0.1:5672/", description="RabbitMQ URL.")
    amqp_urls: str = Field(
        default="",
        description="RabbitMQ URLs, comma-separated, one per cluster node (failover); "
        "when set, used instead of amqp_url.",
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis URL; redis+cluster://host1:port,host2:port/ names a Redis Cluster by "
        "its seed nodes.",
    )
    redis_cluster: bool = Field(
        default=False,
        description="Talk to redis_url as a Redis Cluster (implied by a redis+cluster:// URL).",
    )
    amqp_tls: TlsFiles = Field(
        default=TlsFiles(),
        description="CA file, client certificate and key for amqps:// addresses "
        "(LOOPWIRE_AMQP_TLS__CA_FILE, __CERT_FILE, __KEY_FILE); see docs/operations.md.",
    )
    redis_tls: TlsFiles = Field(
        default=TlsFiles(),
        description="CA file, client certificate and key for a rediss:// URL "
        "(LOOPWIRE_REDIS_TLS__CA_FILE, __CERT_FILE, __KEY_FILE).",
    )

    @field_validator("amqp_url")
    @classmethod
    def _an_amqp_url(cls, url: str) -> str:
        return amqp.check_url(url)

    @field_validator("amqp_urls")
    @classmethod
    def _amqp_urls(cls, urls: str) -> str:
        return ",".join(amqp.check_url(u) for u in urls.split(",") if u.strip())

    @field_validator("redis_url")
    @classmethod
    def _a_redis_url(cls, url: str) -> str:
        return redis_client.check_url(url)
