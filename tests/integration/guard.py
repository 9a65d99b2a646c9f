"""The suite's guard against a cascade: when the services every integration test needs have
gone (Redis down, RabbitMQ refusing or blocking publishers on a resource alarm, the disk all
but full), every later test would fail the same way, each after its own timeout, and a run of
a few minutes would last hours. After an integration test fails, ``services_problem`` asks
the services directly; the suite stops at once with what it found (conftest.py), and also
after ``STREAK`` integration tests in a row have failed, whatever the cause."""

from __future__ import annotations

import shutil
import socket
import tempfile
import urllib.parse
import urllib.request

import redis
from support_rpc import AMQP_URL, REDIS_URL

STREAK = 10
"""Integration tests failed in a row after which the suite stops."""
MIN_FREE_DISK = 200 * 1024 * 1024
"""Below this, logs and RabbitMQ's own disk alarm (50 MB by default) are near."""
RABBIT_METRICS = "http://127.0.0.1:15692/metrics"
"""RabbitMQ's Prometheus plugin (enabled by scripts/lib.sh): its alarm gauges."""
ALARMS = (
    "rabbitmq_alarms_free_disk_space_watermark",
    "rabbitmq_alarms_memory_used_watermark",
    "rabbitmq_alarms_file_descriptor_limit",
)


def services_problem() -> str | None:
    """What is wrong with the shared services, or None when they answer and nothing is
    alarmed. Bounded: each probe gives up after a few seconds."""
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < MIN_FREE_DISK:
        return f"only {free // (1024 * 1024)} MB free on {tempfile.gettempdir()}"
    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=3, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        return f"Redis at {REDIS_URL} does not answer: {exc}"
    url = urllib.parse.urlsplit(AMQP_URL)
    try:
        socket.create_connection((url.hostname or "127.0.0.1", url.port or 5672), 3).close()
    except OSError as exc:
        return f"RabbitMQ at {url.hostname}:{url.port or 5672} refuses connections: {exc}"
    if url.hostname in ("127.0.0.1", "localhost"):
        return _alarm()
    return None


def _alarm() -> str | None:
    try:
        with urllib.request.urlopen(RABBIT_METRICS, timeout=3) as response:
            text = response.read().decode()
    except OSError:
        return None  # the plugin is optional; the connection probe above still held
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ALARMS and value.strip() not in ("0", "0.0"):
            return f"RabbitMQ raised a resource alarm ({name}): it blocks every publisher"
    return None
