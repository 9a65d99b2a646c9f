"""Suites that start their own servers: a Redis Cluster, a three-node RabbitMQ cluster, TLS
listeners. ``./scripts/test-cluster`` runs them (``.ci/run`` after the main suite); the main
``./scripts/test`` leaves them out. Each suite starts what it needs on local ports and stops it,
and never touches the shared broker or Redis beyond what it names."""

from __future__ import annotations

import pytest
from support_rpc import ensure_test_vhost


@pytest.fixture(scope="session", autouse=True)
def test_vhost() -> None:
    """The shared broker's test vhost, as the integration suite has it (some suites run their
    workers there while their Redis is a cluster of their own)."""
    ensure_test_vhost()
