"""The bridge's metrics (``loopwire_mcp_*``), beside the tool service's own, on the process's
registry. ``server`` is a configured server's name (bounded by the configuration file).

- ``loopwire_mcp_calls_total{server, outcome}``: ``tools/call`` requests, ``outcome`` one of
  ``ok``, ``tool_error`` (``isError``), ``protocol_error``, ``timeout``, ``unavailable``
  (server not connected: not sent), ``connection_lost`` (the server went away mid-call).
- ``loopwire_mcp_server_restarts_total{server}``: sessions started again after one was lost
  or could not start (a stdio server restarted, an HTTP server reconnected).
- ``loopwire_mcp_tool_list_refreshes_total{server, trigger}``: tool listings, ``trigger``
  ``connect``, ``changed`` (the server said its list changed) or ``ttl``.
- ``loopwire_mcp_server_up{server}``: 1 while the session is up.
- ``loopwire_mcp_tools{server}``: tools the bridge offers of that server now.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge

OUTCOMES: Final = (
    "ok",
    "tool_error",
    "protocol_error",
    "timeout",
    "unavailable",
    "connection_lost",
)
TRIGGERS: Final = ("connect", "changed", "ttl")


class McpMetrics:
    def __init__(self, registry: CollectorRegistry, servers: Iterable[str] = ()) -> None:
        self.calls = Counter(
            "loopwire_mcp_calls",
            "tools/call requests to MCP servers, by server and outcome.",
            ["server", "outcome"],
            registry=registry,
        )
        self.restarts = Counter(
            "loopwire_mcp_server_restarts",
            "MCP sessions started again (a stdio server restarted, an HTTP server reconnected).",
            ["server"],
            registry=registry,
        )
        self.refreshes = Counter(
            "loopwire_mcp_tool_list_refreshes",
            "Tool listings of MCP servers, by trigger (connect, changed, ttl).",
            ["server", "trigger"],
            registry=registry,
        )
        self.up = Gauge(
            "loopwire_mcp_server_up",
            "1 while the MCP session is up.",
            ["server"],
            registry=registry,
        )
        self.tools = Gauge(
            "loopwire_mcp_tools", "Tools offered of the MCP server.", ["server"], registry=registry
        )
        for server in servers:  # every series at 0 from the start
            for outcome in OUTCOMES:
                self.calls.labels(server, outcome)
            for trigger in TRIGGERS:
                self.refreshes.labels(server, trigger)
            self.restarts.labels(server)
            self.up.labels(server).set(0)
            self.tools.labels(server).set(0)
