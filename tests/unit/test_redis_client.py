"""The one Redis client factory: which client a URL and the cluster setting give (no server
is contacted; the cluster suite runs them against a real Redis Cluster)."""

from __future__ import annotations

import pytest
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster

from contracts.runtime.redis_client import (
    ClusterURL,
    is_cluster,
    parse_cluster_url,
    ready,
    redis_client,
)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "redis+cluster://10.0.0.1:7000,10.0.0.2:7001,10.0.0.3/",
            ClusterURL(nodes=(("10.0.0.1", 7000), ("10.0.0.2", 7001), ("10.0.0.3", 6379))),
        ),
        (
            "rediss+cluster://app:s%40cret@redis-0:6380,redis-1:6380",
            ClusterURL(
                nodes=(("redis-0", 6380), ("redis-1", 6380)),
                username="app",
                password="s@cret",
                tls=True,
            ),
        ),
        (
            "redis://:pw@[::1]:7000/0",
            ClusterURL(nodes=(("::1", 7000),), password="pw"),
        ),
    ],
)
def test_a_cluster_url_names_its_seed_nodes(url: str, expected: ClusterURL) -> None:
    assert parse_cluster_url(url) == expected


@pytest.mark.parametrize("url", ["redis+cluster://h:7000/2", "redis://h:6379/3"])
def test_a_cluster_has_only_database_0(url: str) -> None:
    with pytest.raises(ValueError, match="only database 0"):
        parse_cluster_url(url)


def test_a_cluster_url_gives_a_cluster_client() -> None:
    client = redis_client("redis+cluster://127.0.0.1:7000,127.0.0.1:7001/", max_connections=9)
    assert isinstance(client, RedisCluster)
    assert is_cluster(client)
    seeds = client.nodes_manager.startup_nodes
    assert sorted(seeds) == ["127.0.0.1:7000", "127.0.0.1:7001"]
    assert all(node.max_connections == 9 for node in seeds.values())


def test_the_cluster_setting_takes_a_plain_url_as_a_seed() -> None:
    client = redis_client("redis://127.0.0.1:7000", cluster=True)
    assert isinstance(client, RedisCluster)
    assert list(client.nodes_manager.startup_nodes) == ["127.0.0.1:7000"]


async def test_one_redis_gets_a_blocking_pool_and_ready_connects_nothing() -> None:
    client = redis_client("redis://127.0.0.1:1/5", max_connections=7, timeout=2.5)
    assert type(client) is Redis
    assert not is_cluster(client)
    pool = client.connection_pool
    assert isinstance(pool, BlockingConnectionPool)
    assert pool.max_connections == 7
    assert pool.timeout == 2.5
    assert pool.connection_kwargs["db"] == 5
    assert pool.connection_kwargs["socket_timeout"] == 2.5
    assert await ready(client) is client  # port 1: nothing listens, and nothing was tried
    await client.aclose()
