"""The worker's Prometheus metrics, on a ``CollectorRegistry`` that is passed in.

Nothing here touches prometheus-client's global registry: a worker process
creates one registry, hands it to ``WorkerMetrics`` and serves it on
``/metrics`` (``contracts.runtime.health``); tests create their own registry per test.

``WorkerMetrics`` is the loop's ``LoopObserver`` (turns, steps, model calls,
tool calls, empty-streak hints, iteration caps) and the transport's counter
(dead-lettered, dropped and retried work, published events, state-store
latency, steps in hand, tool calls awaiting their reply).

Names follow Prometheus conventions (base units, ``_total``, ``_seconds``);
model calls use the OpenTelemetry GenAI metrics as they translate to
Prometheus (``gen_ai_client_operation_duration_seconds``,
``gen_ai_client_token_usage``) with their attribute names as labels.

Decisions:

- Bounded labels only: agent names (unknown agents are rejected before a
  step runs), model names from configuration, tool names the catalog offered
  (a name the model invented is ``_unknown``), fixed outcome and reason codes.
  Never a session, turn or call id.
- Turns in progress: a worker holds a turn only while it runs one of its
  steps, and the next step may run on any worker, so no single process can
  keep a fleet-wide gauge of open turns (and a started-minus-finished
  difference of per-process counters breaks whenever a process restarts).
  Each worker exports ``loopwire_steps_in_progress`` (the step messages in its
  hands now, exact) and the counters ``loopwire_turns_started_total`` and
  ``loopwire_turns_finished_total``. Dashboards show open turns as
  ``sum(rate(loopwire_turn_duration_seconds_sum[5m]))`` (Little's law: the
  mean number of turns open over the window) next to the steps in hand and
  the depth of ``loopwire.turns`` (RabbitMQ's own metric).
- A ``tenant`` label only when asked for (``LOOPWIRE_TENANTS__METRICS_LABEL`` with tenancy
  on): then the turn-level series (``TENANT_LABELLED``) carry the tenant the work is done for
  (``contracts.tenancy``), each of the first ``LOOPWIRE_TENANTS__METRICS_MAX_TENANTS``
  distinct tenants this process sees under its own name and the rest as ``other``
  (``TenantLabel``), so the series stay bounded however many tenants there are; work whose
  tenant was refused (``tenant_mismatch``) is ``_unknown``. Off, the series have exactly the
  labels they always had, and the choice is made once, at construction: nothing is asked of
  the tenancy on the way.
- Counted when it happened in this process. A step redone after a crash or a
  lost lease race may count its model call, tool calls and hints again (they
  did run again, except what was saved); turns are counted started and
  finished only after the state that records it was saved.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from contracts.events import EVENT_TYPES
from contracts.messages import Usage
from contracts.runtime.metrics import TOOL_BUCKETS, build_info, package_version, sample_names
from contracts.turns import TurnResult
from worker.loop.ports import LoopObserver, ToolCallOutcome
from worker.loop.spec import AgentSpec
from worker.runtime.metric_bounds import (
    MODEL_DURATION_BUCKETS,
    OPERATION_CHAT,
    STEP_BUCKETS,
    STEPS_PER_TURN_BUCKETS,
    STORE_BUCKETS,
    STORE_OPERATIONS,
    TOKEN_BUCKETS,
    TURN_BUCKETS,
)
from worker.runtime.tenant_label import TenantLabel

__all__ = [
    "TenantLabel",
    "WorkerMetrics",
    "build_info",
    "package_version",
    "sample_names",
]


class WorkerMetrics(LoopObserver):
    """Every metric a worker exports; the loop's observer and the transport's counters.

    ``tenants``: label the turn-level series (``TENANT_LABELLED``) with the tenant, capped as
    it says; ``None`` (tenancy off, or the label not asked for): no ``tenant`` label at all."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        default_model: str = "",
        tenants: TenantLabel | None = None,
    ) -> None:
        self.registry = registry
        self.default_model = default_model
        self.tenants = tenants
        self.scoped = self.child if tenants is None else self._tenant_child
        """``child`` for the metrics in ``TENANT_LABELLED``: the tenant's value appended, when
        labelled (decided here, so that an unlabelled observation costs what it always did)."""
        r = registry
        tenant = ["tenant"] if tenants is not None else []
        self.turns_started = Counter(
            "loopwire_turns_started",
            "Turns whose first step ran.",
            ["agent", *tenant],
            registry=r,
        )
        self.turns_finished = Counter(
            "loopwire_turns_finished",
            "Turns finished, by finish reason (stop, length, max_iterations, error, cancelled, "
            "budget).",
            ["agent", "finish_reason", *tenant],
            registry=r,
        )
        self.turn_duration = Histogram(
            "loopwire_turn_duration_seconds",
            "Time from a turn's start to its result.",
            ["agent", "finish_reason", *tenant],
            buckets=TURN_BUCKETS,
            registry=r,
        )
        self.turn_steps = Histogram(
            "loopwire_turn_steps",
            "Steps (model calls) per finished turn.",
            ["agent", *tenant],
            buckets=STEPS_PER_TURN_BUCKETS,
            registry=r,
        )
        self.step_duration = Histogram(
            "loopwire_step_duration_seconds",
            "One step: from the model call to the last tool result.",
            ["agent", *tenant],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.steps_in_progress = Gauge(
            "loopwire_steps_in_progress",
            "Step messages this worker is running now.",
            registry=r,
        )
        self.model_duration = Histogram(
            "gen_ai_client_operation_duration_seconds",
            "GenAI operation duration (model calls; error_type set when the call failed).",
            ["gen_ai_operation_name", "gen_ai_request_model", "server_address", "error_type"],
            buckets=MODEL_DURATION_BUCKETS,
            registry=r,
        )
        self.model_tokens = Histogram(
            "gen_ai_client_token_usage",
            "Tokens used per model call, by token type (input, output).",
            [
                "gen_ai_operation_name",
                "gen_ai_request_model",
                "server_address",
                "gen_ai_token_type",
                *tenant,
            ],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.model_errors = Counter(
            "loopwire_model_errors",
            "Model calls that failed for good, by error type.",
            ["gen_ai_request_model", "server_address", "error_type"],
            registry=r,
        )
        self.tool_duration = Histogram(
            "loopwire_tool_call_duration_seconds",
            "Tool calls seen from the worker, by tool and outcome "
            "(ok, error, timeout, unavailable, blocked, unknown).",
            ["tool", "outcome", *tenant],
            buckets=TOOL_BUCKETS,
            registry=r,
        )
        self.tool_in_progress = Gauge(
            "loopwire_tool_calls_in_progress",
            "Tool calls this worker sent and awaits the reply of.",
            ["tool"],
            registry=r,
        )
        self.hints = Counter(
            "loopwire_empty_streak_hints",
            "Empty-streak hints appended to tool results.",
            ["agent", *tenant],
            registry=r,
        )
        self.caps = Counter(
            "loopwire_iteration_caps",
            "Turns ended by the iteration cap (max_tool_iterations).",
            ["agent", *tenant],
            registry=r,
        )
        self.budgets = Counter(
            "loopwire_budget_exhausted",
            "Budgets found spent before a model call, by budget (<scope>.<limit>).",
            ["agent", "budget", *tenant],
            registry=r,
        )
        self.agents = Gauge(
            "loopwire_agent_info",
            "The agents this worker has loaded: 1 for each, by prompt version, provider and model.",
            ["agent", "prompt_version", "provider", "model"],
            registry=r,
        )
        self.reload_errors = Counter(
            "loopwire_profile_reload_errors",
            "Agents files that failed to load on a reload (the profiles before stay).",
            registry=r,
        )
        self.fallbacks = Counter(
            "loopwire_model_fallbacks",
            "Model errors after which a step asked the next model of its agent's chain, by the "
            "provider that failed (server_address) and the error.",
            ["server_address", "error_type"],
            registry=r,
        )
        self.children = Counter(
            "loopwire_child_turns_started",
            "Child turns started (sub-agent calls, workflow nodes), by the parent's agent.",
            ["agent", *tenant],
            registry=r,
        )
        self.cancellations = Counter(
            "loopwire_turns_cancelled",
            "Turns ended as cancelled, by reason: cancel (a turn.cancel), deadline.",
            ["agent", "reason", *tenant],
            registry=r,
        )
        self.throttles = Counter(
            "loopwire_steps_throttled",
            "Steps that parked their turn for the model's rate limits (reason: rate_limit, "
            "tenant_rate_limit, or 429 from the model) or in their tenant's line (tenant).",
            ["agent", "reason", *tenant],
            registry=r,
        )
        self.dead_lettered = Counter(
            "loopwire_dead_lettered",
            "Work messages sent to the dead-letter queue, by reason code.",
            ["reason", *tenant],
            registry=r,
        )
        self.dropped = Counter(
            "loopwire_work_dropped",
            "Duplicate or stale work messages acked without doing anything, by reason.",
            ["reason", *tenant],
            registry=r,
        )
        self.session_reads = Counter(
            "loopwire_session_reads",
            "Session reads answered, by op and result (ok, not_found, bad_request, "
            "tenant_mismatch).",
            ["op", "result", *tenant],
            registry=r,
        )
        self.steps_abandoned = Counter(
            "loopwire_steps_abandoned",
            "Steps this worker gave up because another worker took over the session: the "
            "lease was found lost while renewing it (lease_lost), or a save lost its "
            "compare-and-set (stale_state). Each is redone from the last save.",
            ["reason"],
            registry=r,
        )
        self.retried = Counter(
            "loopwire_work_retried",
            "Work messages sent to the delay queue, by reason (busy, transient, failed).",
            ["reason"],
            registry=r,
        )
        self.events = Counter(
            "loopwire_events_published",
            "Lifecycle events published, by type.",
            ["type"],
            registry=r,
        )
        self.event_errors = Counter(
            "loopwire_event_publish_errors",
            "Lifecycle events that could not be published, by type.",
            ["type"],
            registry=r,
        )
        self.store_duration = Histogram(
            "loopwire_state_store_duration_seconds",
            "Latency of state-store (Redis) operations.",
            ["operation"],
            buckets=STORE_BUCKETS,
            registry=r,
        )
        for event_type in EVENT_TYPES:  # at 0 from the start: every query has its series
            self.events.labels(event_type)
            self.event_errors.labels(event_type)
        for reason in ("busy", "transient", "failed"):
            self.retried.labels(reason)
        self._store_ops = {op: self.store_duration.labels(op) for op in STORE_OPERATIONS}
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, remembered: the label lookup is the costly part of an
        observation, and the same few children are observed on every step."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def _tenant_child(self, metric: Any, *values: str) -> Any:
        assert self.tenants is not None
        return self.child(metric, *values, self.tenants())

    def dead_letter(self, reason: str) -> None:
        """One work message dead-lettered with ``reason`` (its code)."""
        self.scoped(self.dead_lettered, reason).inc()

    def _model(self, model: str | None) -> str:
        return model or self.default_model

    # -- LoopObserver ----------------------------------------------------------------------

    def turn_started(self, agent: str) -> None:
        self.scoped(self.turns_started, agent).inc()

    def turn_finished(self, result: TurnResult) -> None:
        reason = result.finish_reason
        self.scoped(self.turns_finished, result.agent, reason).inc()
        self.scoped(self.turn_duration, result.agent, reason).observe(result.duration_s)
        self.scoped(self.turn_steps, result.agent).observe(result.steps)
        if reason == "cancelled":
            why = "deadline" if result.stopped_by == "deadline" else "cancel"
            self.scoped(self.cancellations, result.agent, why).inc()

    def step_completed(self, agent: str, duration_s: float) -> None:
        self.scoped(self.step_duration, agent).observe(max(0.0, duration_s))

    def model_called(
        self, model: str | None, usage: Usage, duration_s: float, provider: str = "default"
    ) -> None:
        name = self._model(model)
        self.child(self.model_duration, OPERATION_CHAT, name, provider, "").observe(
            max(0.0, duration_s)
        )
        self.scoped(self.model_tokens, OPERATION_CHAT, name, provider, "input").observe(
            usage.prompt_tokens
        )
        self.scoped(self.model_tokens, OPERATION_CHAT, name, provider, "output").observe(
            usage.completion_tokens
        )

    def model_failed(
        self, model: str | None, error_type: str, duration_s: float, provider: str = "default"
    ) -> None:
        name = self._model(model)
        self.child(self.model_duration, OPERATION_CHAT, name, provider, error_type).observe(
            max(0.0, duration_s)
        )
        self.child(self.model_errors, name, provider, error_type).inc()

    def tool_executed(self, tool: str, outcome: ToolCallOutcome, duration_s: float) -> None:
        self.scoped(self.tool_duration, tool, outcome).observe(max(0.0, duration_s))

    def empty_streak_hints(self, agent: str, count: int) -> None:
        self.scoped(self.hints, agent).inc(count)

    def iteration_cap_hit(self, agent: str) -> None:
        self.scoped(self.caps, agent).inc()

    def throttled(self, agent: str, reason: str) -> None:
        self.scoped(self.throttles, agent, reason).inc()

    def budget_exhausted(self, agent: str, budget: str) -> None:
        self.scoped(self.budgets, agent, budget).inc()

    def agents_loaded(self, agents: Iterable[AgentSpec], default_model: str) -> None:
        """What ``loopwire_agent_info`` says: the agents loaded now (the ones before are gone)."""
        self.agents.clear()
        for agent in agents:
            head = agent.route[0]
            model = head.model or (default_model if head.provider == "default" else "")
            self.agents.labels(agent.name, agent.prompt_version or "", head.provider, model).set(1)
            if self.tenants is None:  # at 0: the agent's guard series exist (labelled by
                # tenant, they begin with the tenant's first hint or cap)
                self.child(self.hints, agent.name)
                self.child(self.caps, agent.name)

    def model_fallback(self, provider: str, error_type: str) -> None:
        self.child(self.fallbacks, provider, error_type).inc()

    def children_started(self, agent: str, count: int) -> None:
        self.scoped(self.children, agent).inc(count)

    # -- transport ---------------------------------------------------------------------------

    def store_timer(self, operation: str) -> AbstractContextManager[object]:
        """Times one state-store operation: ``with metrics.store_timer("save"): ...``."""
        child = self._store_ops.get(operation) or self.child(self.store_duration, operation)
        return child.time()

    def tool_call_in_progress(self, tool: str) -> AbstractContextManager[object]:
        """Counts a tool RPC as in progress while the block runs."""
        gauge: Gauge = self.child(self.tool_in_progress, tool)
        return gauge.track_inprogress()
