"""The one place a loopwire process builds its Redis client: workers, tool services, the CLI,
the demo and the benchmark all call ``redis_client``.

Two shapes of Redis:

- **One Redis** (``redis://host:port/db``): a ``BlockingConnectionPool``. Past
  ``max_connections`` a command waits (up to ``timeout``) for a free connection instead of
  failing, so a burst of steps queues rather than erroring.
- **Redis Cluster**: ``redis+cluster://host1:port1,host2:port2/`` names several seed nodes
  (any one that answers is enough to discover the rest; give more than one so that a client
  starting while a node is down still finds the cluster), or a plain ``redis://host:port`` URL
  with ``cluster=True`` (``LOOPWIRE_REDIS_CLUSTER=true``) names one. redis-py's
  ``RedisCluster`` routes each command by its key's hash slot, follows ``MOVED``/``ASK`` and
  re-reads the slot map after a failover. A cluster has only database 0. Its pool is per
  node: ``max_connections`` connections to each master, and a command that finds none free
  fails (``MaxConnectionsError``) rather than waiting; the default sizes are far above what a
  worker's prefetch can use at once.

Both are typed ``Redis``: the cluster client offers every command loopwire uses (single-key
commands, ``EVALSHA`` of scripts whose keys share a hash tag, non-transactional pipelines,
which it splits by node but which may carry no script (``is_cluster`` tells the one caller
that pipelines a script), ``SCAN``, which it runs on every master, and multi-key ``UNLINK``,
which it splits by slot). The cluster suite (``tests/cluster``) proves each on a real cluster.

A process that is about to use its client from many coroutines at once (a worker, a tool
service, the benchmark's processes) first awaits ``ready(client)``: a cluster client reads the
cluster's slot map then, once. redis-py's cluster client first used by many coroutines at once
initializes under their feet and races its own fresh connections (``AttributeError:
'NoneType' object has no attribute 'writelines'`` in a few of the first commands, seen with
redis-py 7.4 and 8.1); initialized first, it does not. For one Redis ``ready`` does nothing.

TLS: ``rediss://`` and ``rediss+cluster://`` turn on TLS. ``tls`` (a ``TlsFiles``,
``LOOPWIRE_REDIS_TLS__*``) gives the CA file and a client certificate and key, to every node;
the options are built by ``contracts.runtime.tls.redis_tls_options``, which verifies the
server's certificate and host name (without a CA file, against the system's CAs). TLS files
for a ``redis://`` URL are refused. redis-py also reads ``ssl_ca_certs``, ``ssl_certfile``
and ``ssl_keyfile`` from a single Redis's URL query; a cluster URL's query is not read.

Unreachable. ``check(client, url)`` is what a process runs before it starts work: it raises
``RedisUnreachableError`` naming the address (``host:port``, never a password) and the cause,
and says so when the server's certificate could not be verified.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Final, cast
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from contracts.runtime.tls import RedisTlsOptions, TlsConfigError, TlsFiles, redis_tls_options

CLUSTER_SCHEMES: Final = {"redis+cluster": False, "rediss+cluster": True}
"""URL schemes that name a Redis Cluster (the value: whether it speaks TLS)."""
DEFAULT_PORT: Final = 6379
TLS_SCHEMES: Final = {"rediss", "rediss+cluster"}


class RedisUnreachableError(ConnectionError):
    """Redis did not answer a process starting (the message names the address)."""


@dataclass(frozen=True, slots=True)
class ClusterURL:
    """A Redis Cluster as a URL names it: seed nodes, credentials, TLS."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False


URL_SCHEMES: Final = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)


def check_url(url: str) -> str:
    """``url`` if it is a Redis URL, else ``ValueError`` (which never shows the URL: it may
    hold a password)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in URL_SCHEMES or not (parts.netloc or parts.scheme == "unix"):
        raise ValueError(
            "not a Redis URL: give redis://user:password@host:6379/0 (or rediss://, "
            "redis+cluster://host1:6379,host2:6379/)"
        )
    return url.strip()


def is_cluster(redis: Redis) -> bool:
    """Whether ``redis`` is a cluster client (where a pipeline cannot carry a script)."""
    return isinstance(redis, RedisCluster)


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterURL:
    """``redis+cluster://[user:password@]host1:port1,host2:port2[/0]`` (or a single-node
    ``redis://`` URL); ``ValueError`` when it names a database other than 0."""
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES and parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"not a Redis URL: {_redacted(url)}")
    credentials, _, hosts = parts.netloc.rpartition("@")
    user, _, password = credentials.partition(":")
    path = parts.path.strip("/")
    if path not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, not {path!r}")
    nodes = tuple(_host_port(node) for node in hosts.split(",") if node)
    if not nodes:
        raise ValueError(f"no Redis Cluster node in {_redacted(url)}")
    return ClusterURL(
        nodes=nodes,
        username=unquote(user) or None,
        password=unquote(password) or None,
        tls=CLUSTER_SCHEMES.get(parts.scheme, parts.scheme == "rediss"),
    )


def redis_client(
    url: str,
    *,
    cluster: bool = False,
    max_connections: int = 200,
    timeout: float = 5.0,
    tls: TlsFiles | None = None,
) -> Redis:
    """A client for ``url``: a cluster client when the URL's scheme says so or ``cluster``
    is set, else one over a blocking pool. ``timeout`` bounds connecting, each reply and the
    wait for a free pooled connection. ``tls``: the TLS files of a ``rediss://`` URL."""
    options = _tls_options(url, tls)
    if cluster or is_cluster_url(url):
        return _cluster(parse_cluster_url(url), max_connections, timeout, options)
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        **options,
    )
    return Redis.from_pool(pool)


def address(url: str) -> str:
    """The ``host:port`` list of a Redis URL, for messages: no user, no password."""
    hosts = urlsplit(url).netloc.rpartition("@")[2]
    return ",".join(f"{h}:{p}" for h, p in (_host_port(n) for n in hosts.split(",") if n))


async def check(client: Redis, url: str) -> None:
    """``client`` answers a PING, else ``RedisUnreachableError`` naming ``url``'s address and
    why (a certificate that could not be verified is said to be so)."""
    try:
        await ready(client)
        await client.ping()
    except (RedisError, RedisClusterException, OSError) as exc:
        raise RedisUnreachableError(f"cannot reach Redis at {address(url)}: {_why(exc)}") from None


def _why(exc: BaseException) -> str:
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            break
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(
            seen
        ):
            detail = getattr(seen, "verify_message", None) or str(seen)
            return f"the server's certificate could not be verified: {detail}"
        seen = seen.__cause__ or seen.__context__
    return _redacted(str(exc)) or type(exc).__name__


UNVERIFIED: Final = {"ssl_cert_reqs": ("none", "optional"), "ssl_check_hostname": ("false", "0")}
"""URL query values that would turn verification off in redis-py: refused."""


def _tls_options(url: str, tls: TlsFiles | None) -> RedisTlsOptions:
    query = parse_qs(urlsplit(url).query)
    for option, refused in UNVERIFIED.items():
        if any(value.lower() in refused for value in query.get(option, ())):
            raise TlsConfigError(
                f"{address(url)}: {option} that turns verification off is refused; give the CA "
                "file instead"
            )
    if tls is None or not tls.given:
        return RedisTlsOptions()
    if urlsplit(url).scheme not in TLS_SCHEMES:
        raise TlsConfigError(
            f"Redis TLS files are set but {address(url)} is not a rediss:// address"
        )
    return redis_tls_options(tls)


async def ready(client: Redis) -> Redis:
    """``client`` ready for concurrent use: a cluster client discovers its nodes and slots now
    (``RedisClusterException`` or a connection error when no seed node answers); a client of
    one Redis makes no connection (it connects on first use, as before)."""
    await client.initialize()
    return client


def _cluster(
    target: ClusterURL, max_connections: int, timeout: float, tls: RedisTlsOptions
) -> Redis:
    client = RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
        username=target.username,
        password=target.password,
        max_connections=max_connections,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        ssl=target.tls,
        **tls,
    )
    # the cluster client has the command API of Redis (see the module docstring)
    return cast(Redis, client)


def _host_port(node: str) -> tuple[str, int]:
    """``host:port``, ``host`` (the default port) or ``[v6 address]:port``."""
    if node.startswith("["):
        host, _, rest = node[1:].partition("]")
        return host, int(rest.removeprefix(":") or DEFAULT_PORT)
    host, _, port = node.partition(":")
    return host, int(port or DEFAULT_PORT)


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    return url.replace(parts.password, "***") if parts.password else url
