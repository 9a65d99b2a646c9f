"""Suites that start their own servers: a Redis Cluster, a three-node RabbitMQ cluster, TLS
listeners. ``./scripts/test-cluster`` runs them (``.ci/run`` after the main suite); the main
``./scripts/test`` leaves them out. Each suite starts what it needs on local ports and stops it,
and never touches the shared broker or Redis beyond what it names."""

from __future__ import annotations
