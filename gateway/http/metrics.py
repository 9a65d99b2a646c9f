"""The gateway's own metrics (``/metrics``): requests by route and status, their latency, and
the streams open now."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "loopwire_gateway_requests_total",
            "HTTP requests answered, by method, route and status.",
            ["method", "route", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "loopwire_gateway_request_seconds",
            "Time to the response's start (a stream's first byte), by route.",
            ["route"],
            registry=registry,
        )
        self.streams = Gauge(
            "loopwire_gateway_open_streams",
            "Server-sent event streams open now.",
            registry=registry,
        )

    def observe(self, method: str, route: str, status: int, started: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(route).observe(time.monotonic() - started)
