"""Where the ``loopwire`` command finds RabbitMQ and Redis: the settings every process reads
(``contracts.runtime.connection.ConnectionSettings``: ``LOOPWIRE_AMQP_URLS`` /
``LOOPWIRE_AMQP_URL``, ``LOOPWIRE_REDIS_URL``, ``LOOPWIRE_REDIS_CLUSTER``, the TLS files,
each also as ``_FILE``), read the same way, with ``--amqp-url``, ``--redis-url`` and
``--redis-cluster`` winning over them. A setting or an option that cannot be used is refused
with the variable or the option named (exit 2), never replaced by a default.

The tenant the command acts for (docs/tenants.md) is read the same way: ``LOOPWIRE_TENANT``
(or its ``_FILE`` form), with ``--tenant`` winning over it. Unset, the command acts as it
always did: for the default tenant, or, with tenancy on, for the tenant of its user.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pydantic import Field, field_validator

from contracts import tenancy
from contracts.runtime import amqp, redis_client
from contracts.runtime.connection import ConnectionSettings
from contracts.runtime.loading import SettingsError, load
from contracts.runtime.tls import TlsFiles
from worker.cli import arguments, exits
from worker.errors import CliError


class CliSettings(ConnectionSettings):
    """What the ``loopwire`` command reads beyond what every process does (the worker does not
    read ``LOOPWIRE_TENANT``: it takes each message's tenant from the message)."""

    tenant: str | None = Field(
        default=None,
        description="The tenant the loopwire command acts for (--tenant wins over it).",
    )

    @field_validator("tenant")
    @classmethod
    def _a_tenant_name(cls, value: str | None) -> str | None:
        if value is not None and not tenancy.valid(value):
            raise ValueError(arguments.SAFE_ID_RULE)
        return value


@dataclass(frozen=True, slots=True)
class Connection:
    amqp_url: str
    """One AMQP URL, or one per cluster node, comma-separated."""
    redis_url: str
    redis_cluster: bool
    amqp_tls: TlsFiles
    redis_tls: TlsFiles
    tenant: str | None = None
    """The tenant the command acts for (``--tenant``, ``LOOPWIRE_TENANT``); ``None``: none named."""


def add_options(parser: argparse.ArgumentParser) -> None:
    """The connection options and ``--tenant``, accepted before or after the command
    (``SUPPRESS``: an option not given leaves the settings' value)."""
    parser.add_argument(
        "--amqp-url",
        default=argparse.SUPPRESS,
        help="RabbitMQ URL, or one per cluster node, comma-separated (default: "
        "$LOOPWIRE_AMQP_URLS or $LOOPWIRE_AMQP_URL, or their _FILE forms)",
    )
    parser.add_argument(
        "--redis-url",
        default=argparse.SUPPRESS,
        help="Redis URL, for the commands that read Redis (default: $LOOPWIRE_REDIS_URL or "
        "its _FILE form); redis+cluster://host1:port,host2:port/ for a Redis Cluster",
    )
    parser.add_argument(
        "--redis-cluster",
        action="store_true",
        default=argparse.SUPPRESS,
        help="the Redis URL names a Redis Cluster node (default: $LOOPWIRE_REDIS_CLUSTER)",
    )
    parser.add_argument(
        "--tenant",
        metavar="NAME",
        default=argparse.SUPPRESS,
        help="act for this tenant, on a fleet with tenancy on (docs/tenants.md): its sessions, "
        "turns, approvals and events only (default: $LOOPWIRE_TENANT)",
    )


def connection(args: argparse.Namespace) -> Connection:
    try:
        settings = load(CliSettings)
    except SettingsError as exc:
        raise CliError(str(exc), exits.USAGE) from None
    given_tenant = getattr(args, "tenant", None)
    if given_tenant is not None:
        arguments.safe_id(given_tenant, "--tenant")
    given_amqp, given_redis = checked_options(args)
    return Connection(
        amqp_url=given_amqp or settings.amqp_urls or settings.amqp_url,
        redis_url=given_redis or settings.redis_url,
        redis_cluster=bool(getattr(args, "redis_cluster", False) or settings.redis_cluster),
        amqp_tls=settings.amqp_tls,
        redis_tls=settings.redis_tls,
        tenant=settings.tenant if given_tenant is None else given_tenant,
    )


def checked_options(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``--amqp-url`` and ``--redis-url`` as given (``None``: not given), each checked as the
    settings check the variables; one that cannot be used is refused naming the option."""
    given = getattr(args, "amqp_url", None)
    amqp_url = None if given is None else _amqp_urls(given)
    redis_url = getattr(args, "redis_url", None)
    if redis_url is not None:
        try:
            redis_url = redis_client.check_url(redis_url)
        except ValueError as exc:
            raise CliError(f"--redis-url: {exc}", exits.USAGE) from None
    return amqp_url, redis_url


def _amqp_urls(value: str) -> str:
    try:
        urls = [amqp.check_url(url) for url in value.split(",") if url.strip()]
    except ValueError as exc:
        raise CliError(f"--amqp-url: {exc}", exits.USAGE) from None
    if not urls:
        raise CliError("--amqp-url: no URL given", exits.USAGE)
    return ",".join(urls)
