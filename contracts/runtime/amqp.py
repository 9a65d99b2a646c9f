"""Connecting to RabbitMQ: the one function every loopwire process uses (the worker, tool
services, the memory service's events, the client SDK and the CLI).

Addresses. A process takes a list of AMQP URLs, one per node of a RabbitMQ cluster
(``LOOPWIRE_AMQP_URLS``, comma-separated; the client takes a list). Without it, the single
``LOOPWIRE_AMQP_URL`` is the list (``resolve_urls``). Options in a URL's query string (TLS
files, heartbeat) are read from the address the process starts on; give every address the
same ones.

TLS. ``amqps://`` addresses with ``tls`` (a ``TlsFiles``: ``LOOPWIRE_AMQP_TLS__*``): one
``ssl.SSLContext`` built by ``contracts.runtime.tls`` serves every address, and it verifies the
server's certificate and host name. aiormq also reads ``cafile``, ``certfile`` and ``keyfile``
from an ``amqps://`` URL's query; that form still works without ``tls``, and giving both is
refused. A certificate that does not verify fails the attempt like an unreachable node: the
error names the address and says the certificate could not be verified.

Failover. aio-pika's robust connection reconnects to the one URL it was given, and aio-pika
has no list of URLs. ``FailoverConnection`` is that robust connection with a list: whenever
a connection attempt fails or an established connection closes, the next attempt (after
``reconnect_interval``) goes to the next address, round robin, until one answers. What a
process declared on its channels (exchanges, queues, bindings) and its consumers are then
restored on whatever node it reached, by aio-pika's robust channels, exactly as after a
reconnect to the same node; the ``reconnect_callbacks`` run once every channel is back. The
first ``connect`` tries each address once, in order, and fails only when none answers.

What survives a node. loopwire's queues are quorum queues (replicated on every node of a
three-node cluster; one node lost keeps a majority). A process's *reply queues* (the worker's
tool-reply queue, the client's reply queue) are exclusive, auto-deleted classic queues on
purpose: they belong to one connection, a quorum queue cannot be exclusive, and a durable
reply queue would outlive the process that reads it. When the node holding one goes, the
queue goes with the connection and is declared again on the next node; what was addressed to
it in between is recovered by the protocol, not by the queue: the worker fails the tool calls
it was waiting on as retryable and redoes the step, the calls carry their idempotency key and
the tool service answers from its stored reply; the client publishes its waiting turns'
requests again and loopwire answers each from the turn's stored result.

Logs and metrics. An address is logged as ``host:port/vhost`` (``address``): never a user
name or a password. ``AmqpMetrics`` (on the process's registry) counts reconnects
(``loopwire_amqp_reconnects_total``) and says which address is connected
(``loopwire_amqp_connected{address}``, 1 for the connected one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Sequence
from typing import Any

from aio_pika.abc import AbstractRobustConnection
from aio_pika.exceptions import CONNECTION_EXCEPTIONS
from aio_pika.robust_connection import RobustConnection
from prometheus_client import CollectorRegistry, Counter, Gauge
from yarl import URL

from contracts.runtime.tls import TlsConfigError, TlsFiles, amqp_ssl_context

log = logging.getLogger("loopwire.amqp")

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
CONNECT_TIMEOUT_S = 10.0
"""One connection attempt (TCP, TLS, AMQP handshake) gives up after this long."""


class AmqpUnreachableError(ConnectionError):
    """No address of the list answered."""


def resolve_urls(
    url: str = DEFAULT_URL, urls: str | Sequence[str] | None = None
) -> tuple[str, ...]:
    """The addresses to use: ``urls`` (a comma-separated string or a list) when it names any,
    else ``url`` alone."""
    if isinstance(urls, str):
        urls = urls.split(",")
    listed = tuple(u.strip() for u in urls or () if u.strip())
    return listed or (url,)


AMQP_SCHEMES = ("amqp", "amqps")


def check_url(url: str) -> str:
    """``url`` if it is an AMQP URL with a host, else ``ValueError`` (which never shows the
    URL: it may hold a password)."""
    try:
        parsed = URL(url.strip())
    except ValueError:
        parsed = URL()
    if parsed.scheme not in AMQP_SCHEMES or not parsed.host:
        raise ValueError("not an AMQP URL: give amqp://user:password@host:5672/vhost (or amqps://)")
    return url.strip()


def login(url: str | URL) -> str | None:
    """The user a connection to ``url`` logs in as (aiormq's default ``guest`` when the URL
    names none); ``None`` when it authenticates with a client certificate (``auth=external``):
    the broker names the user then."""
    parsed = URL(str(url))
    if parsed.query.get("auth", "plain").lower() == "external":
        return None
    return parsed.user or "guest"


def address(url: str | URL) -> str:
    """``host:port/vhost`` of an AMQP URL, for logs and labels: no user, no password."""
    parsed = URL(str(url))
    port = parsed.port or (5671 if parsed.scheme == "amqps" else 5672)
    return f"{parsed.host}:{port}{parsed.raw_path or '/'}"


class AmqpMetrics:
    """``loopwire_amqp_reconnects_total`` and ``loopwire_amqp_connected{address}`` on
    ``registry`` (one per process: its main connection)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.reconnects = Counter(
            "loopwire_amqp_reconnects",
            "Times the broker connection was lost and made again (to any address).",
            registry=registry,
        )
        self.connected = Gauge(
            "loopwire_amqp_connected",
            "1 for the broker address the process is connected to, 0 for the others.",
            ["address"],
            registry=registry,
        )

    def addresses(self, urls: Sequence[str]) -> None:
        for url in urls:
            self.connected.labels(address(url)).set(0)


class FailoverConnection(RobustConnection):
    """A robust connection over a list of addresses: each new attempt after a failed attempt
    or a lost connection goes to the next address."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        start: int = 0,
        metrics: AmqpMetrics | None = None,
        **kwargs: Any,
    ) -> None:
        if not urls:
            raise ValueError("no AMQP address given")
        self._urls = tuple(URL(u) for u in urls)
        self._index = start % len(self._urls)
        self._metrics = metrics
        self._was_connected = False
        super().__init__(self._urls[self._index], **kwargs)
        self.name = str(self.kwargs.get("client_properties", {}).get("connection_name", "amqp"))
        """The connection's name (in the broker's list and in these logs)."""

    @property
    def address(self) -> str:
        """The address in use (or the next one tried, while disconnected)."""
        return address(self.url)

    async def _on_connection_close(self, closing: asyncio.Future[Any]) -> None:
        # reached both when an established connection closes and when an attempt fails; the
        # next attempt starts from the connection's own task, after this returns
        lost = self.address
        up = self.connected.is_set()
        if self._metrics is not None:
            self._metrics.connected.labels(lost).set(0)
        await super()._on_connection_close(closing)
        if self._close_called:
            return
        self._index = (self._index + 1) % len(self._urls)
        self.url = self._urls[self._index]
        if up:
            log.warning(
                "%s: lost the broker connection to %s (%s); reconnecting, next to %s",
                self.name,
                lost,
                _reason(closing),
                self.address,
            )
        else:
            log.info("%s: could not connect to %s (%s)", self.name, lost, _reason(closing))

    async def _on_connected(self) -> None:
        await super()._on_connected()  # restores every channel, then the reconnect callbacks
        if self._metrics is not None:
            self._metrics.connected.labels(self.address).set(1)
        if self._was_connected:
            if self._metrics is not None:
                self._metrics.reconnects.inc()
            log.warning(
                "%s: reconnected to the broker at %s; every channel restored",
                self.name,
                self.address,
            )
        else:
            log.info("%s: connected to the broker at %s", self.name, self.address)
        self._was_connected = True


def _reason(closing: asyncio.Future[Any]) -> str:
    if closing.cancelled():
        return "cancelled"
    exc = closing.exception()
    return repr(exc) if exc is not None else "closed"


async def connect(
    urls: str | Sequence[str],
    *,
    name: str,
    reconnect_interval_s: float = 1.0,
    metrics: AmqpMetrics | None = None,
    timeout_s: float = CONNECT_TIMEOUT_S,
    tls: TlsFiles | None = None,
) -> AbstractRobustConnection:
    """A connected ``FailoverConnection`` over ``urls`` (a list, or one URL), named ``name``
    in the broker's connection list, with the TLS files ``tls`` for ``amqps://`` addresses.
    Tries each address once, in order; raises ``AmqpUnreachableError`` (naming the addresses,
    never a password) when none answers, ``TlsConfigError`` for TLS settings it cannot use."""
    listed = resolve_urls(urls=urls) if isinstance(urls, str) else tuple(urls)
    if not listed:
        raise ValueError("no AMQP address given")
    context = tls_context(listed, tls)
    if metrics is not None:
        metrics.addresses(listed)
    failures: list[str] = []
    for start in range(len(listed)):
        connection = FailoverConnection(
            listed,
            start=start,
            metrics=metrics,
            client_properties={"connection_name": name},
            reconnect_interval=reconnect_interval_s,
            ssl_context=context,
        )
        try:
            await connection.connect(timeout=timeout_s)
        except (*CONNECTION_EXCEPTIONS, TimeoutError) as exc:
            failures.append(f"{address(listed[start])} ({_describe(exc)})")
            with contextlib.suppress(Exception):
                await connection.close()
            continue
        return connection
    raise AmqpUnreachableError("cannot reach RabbitMQ at " + ", ".join(failures))


TLS_QUERY_OPTIONS = ("cafile", "capath", "cadata", "certfile", "keyfile", "no_verify_ssl")
"""What aiormq reads from an ``amqps://`` URL's query string."""


def tls_context(urls: Sequence[str], tls: TlsFiles | None) -> ssl.SSLContext | None:
    """The one TLS context of every address (``None``: no TLS files given; an ``amqps://``
    URL then uses its query's files, or the system's CAs). An address whose query turns
    verification off (aiormq's ``no_verify_ssl``) is refused."""
    for url in urls:
        if URL(url).query.get("no_verify_ssl", "0") != "0":
            raise TlsConfigError(
                f"{address(url)}: no_verify_ssl is refused; give the CA file instead"
            )
    if tls is None or not tls.given:
        return None
    for url in urls:
        parsed = URL(url)
        if parsed.scheme != "amqps":
            raise TlsConfigError(
                f"AMQP TLS files are set but {address(parsed)} is not an amqps:// address"
            )
        if any(option in parsed.query for option in TLS_QUERY_OPTIONS):
            raise TlsConfigError(
                f"give the AMQP TLS files as settings or in the URL of {address(parsed)}, not both"
            )
    return amqp_ssl_context(tls)


def _describe(exc: BaseException) -> str:
    reason = _tls_reason(exc)
    if reason is not None:
        return f"the server's certificate could not be verified: {reason}"
    return str(exc) or type(exc).__name__


def _tls_reason(exc: BaseException | None) -> str | None:
    """The verification failure somewhere in ``exc``'s chain (aiormq wraps it), if any."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, ssl.SSLCertVerificationError):
            return exc.verify_message or str(exc)
        for arg in exc.args:
            if isinstance(arg, ssl.SSLCertVerificationError):
                return arg.verify_message or str(arg)
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None
