"""A tool service's Prometheus metrics, on a ``CollectorRegistry`` that is passed in.

The process runner (``tool_services.runner``) creates the registry, serves it on
``/metrics`` with ``/livez`` and ``/readyz`` (``contracts.runtime.health.HealthServer``) when
``LOOPWIRE_TOOLS__HTTP_PORT`` is set, and hands it to the server; an embedded
``ToolServer`` without one counts into a private registry. Tests never touch
prometheus-client's global registry.

Labels are bounded: ``tool`` is one of the service's own tool names (anything
else is ``_unknown``), ``outcome`` and ``reason`` are fixed codes.

- ``loopwire_tool_service_call_duration_seconds{tool, outcome}``: calls this
  instance ran, ``outcome`` ``ok``, ``error`` or ``timeout`` (its time budget
  or the call's deadline ran out).
- ``loopwire_tool_service_calls_in_progress{tool}``: calls running now.
- ``loopwire_tool_service_calls_waiting``: deliveries waiting for one of the
  ``concurrency`` slots.
- ``loopwire_tool_service_calls_not_run_total{tool, reason}``: deliveries
  answered or dropped without running the tool: ``replayed`` (answered from the
  stored reply of an earlier run), ``orphaned`` (a non-idempotent call whose
  owner died: answered ``unknown``), ``expired`` (deadline passed: dropped),
  ``undecodable``, ``unknown_tool``, ``store_unavailable`` (Redis down:
  answered with an error).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from contracts.runtime.metrics import TOOL_BUCKETS
from tool_services.execute import RunOutcome

UNKNOWN_TOOL: Final = "_unknown"


NOT_RUN_REASONS = (
    "expired",
    "orphaned",
    "replayed",
    "store_unavailable",
    "undecodable",
    "unknown_tool",
)
"""Why a delivery was answered or dropped without running its tool."""


class ToolServiceMetrics:
    def __init__(self, registry: CollectorRegistry, *, tools: Iterable[str] = ()) -> None:
        self.registry = registry
        self.tools: set[str] = set()
        self.call_duration = Histogram(
            "loopwire_tool_service_call_duration_seconds",
            "Tool calls run by this tool service, by tool and outcome (ok, error, timeout).",
            ["tool", "outcome"],
            buckets=TOOL_BUCKETS,
            registry=registry,
        )
        self.in_progress = Gauge(
            "loopwire_tool_service_calls_in_progress",
            "Tool calls running now.",
            ["tool"],
            registry=registry,
        )
        self.waiting = Gauge(
            "loopwire_tool_service_calls_waiting",
            "Deliveries waiting for a free concurrency slot.",
            registry=registry,
        )
        self.not_run = Counter(
            "loopwire_tool_service_calls_not_run",
            "Deliveries answered or dropped without running the tool, by reason.",
            ["tool", "reason"],
            registry=registry,
        )
        self.add_tools(tools)

    def add_tools(self, tools: Iterable[str]) -> None:
        """Label series for these tools too (a dynamic service's new tools)."""
        for tool in tools:
            if tool in self.tools:
                continue
            self.tools.add(tool)
            self.in_progress.labels(tool)
            for reason in NOT_RUN_REASONS:  # at 0 from the start: every query has its series
                self.not_run.labels(tool, reason)

    def label(self, tool: str | None) -> str:
        """``tool`` when this service serves it, else ``_unknown``."""
        return tool if tool in self.tools else UNKNOWN_TOOL

    def ran(self, tool: str, outcome: RunOutcome, duration_s: float) -> None:
        self.call_duration.labels(self.label(tool), outcome).observe(max(0.0, duration_s))

    def skipped(self, tool: str | None, reason: str) -> None:
        self.not_run.labels(self.label(tool), reason).inc()

    def track_waiting(self, count: Callable[[], int]) -> None:
        self.waiting.set_function(lambda: float(count()))
