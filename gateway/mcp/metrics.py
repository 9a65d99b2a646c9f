"""The MCP server's Prometheus metrics, on a ``CollectorRegistry`` that is passed in.

``loopwire mcp serve --metrics-port N`` serves them on ``/metrics`` (with ``/livez`` and
``/readyz``, ``contracts.runtime.health``). Labels are bounded: ``tool`` is an exposed
tool's name (anything else is ``_unknown``), ``outcome`` a fixed code.

- ``loopwire_mcp_call_duration_seconds{tool, outcome}``: tool calls answered, from the call
  to its answer. ``outcome``: ``answered`` (the agent answered), ``not_answered`` (the turn
  failed, was cancelled or stopped at its iteration cap), ``rejected`` (a worker refused the
  turn), ``cancelled`` (the MCP caller cancelled the call: the turn was sent ``turn.cancel``),
  ``timeout`` (no result within the server's ``--timeout`` and its grace: the turn was sent
  ``turn.cancel``), ``failed`` (the server could not follow the turn, e.g. the broker went
  away: the turn was sent ``turn.cancel``), ``invalid_arguments``, ``unknown_tool``.
- ``loopwire_mcp_calls_in_progress{tool}``: calls whose turn runs now.
- ``loopwire_mcp_calls_waiting_for_approval{tool}``: of those, calls whose turn waits for a
  human decision.
- ``loopwire_mcp_progress_notifications_total{tool}``: progress notifications sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

UNKNOWN_TOOL: Final = "_unknown"
CALL_BUCKETS: Final = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)
"""A call lasts a whole turn: seconds to minutes, an hour when it waits for a decision."""

Outcome = Literal[
    "answered",
    "not_answered",
    "rejected",
    "cancelled",
    "timeout",
    "failed",
    "invalid_arguments",
    "unknown_tool",
]


class McpMetrics:
    def __init__(self, registry: CollectorRegistry, *, tools: Iterable[str] = ()) -> None:
        self.registry = registry
        self.tools = frozenset(tools)
        self.call_duration = Histogram(
            "loopwire_mcp_call_duration_seconds",
            "MCP tool calls answered, by tool and outcome.",
            ["tool", "outcome"],
            buckets=CALL_BUCKETS,
            registry=registry,
        )
        self.in_progress = Gauge(
            "loopwire_mcp_calls_in_progress",
            "MCP tool calls whose turn runs now.",
            ["tool"],
            registry=registry,
        )
        self.waiting = Gauge(
            "loopwire_mcp_calls_waiting_for_approval",
            "MCP tool calls whose turn waits for a human decision now.",
            ["tool"],
            registry=registry,
        )
        self.progress = Counter(
            "loopwire_mcp_progress_notifications",
            "Progress notifications sent to MCP callers.",
            ["tool"],
            registry=registry,
        )
        for tool in self.tools:  # at 0 from the start: every query has its series
            self.in_progress.labels(tool)
            self.waiting.labels(tool)
            self.progress.labels(tool)

    def label(self, tool: str) -> str:
        return tool if tool in self.tools else UNKNOWN_TOOL

    def called(self, tool: str, outcome: Outcome, duration_s: float) -> None:
        self.call_duration.labels(self.label(tool), outcome).observe(duration_s)
