"""Scenarios of features a step may use, each against loopwire without it, in alternating
order at the first session count: ``subagent`` (a step calling a sub-agent instead of a tool)
and ``context`` (a context budget: configured and never reached, and cutting the 40-message
history on every step).

``subagent``: what a step costs when it calls a sub-agent instead of a tool.

Two loopwire targets under the same load, in alternating order: the bench agent calling the
calculator tool in every step (the step scenario's workload), and the bench agent calling the
``bench_helper`` agent in every step: a child turn of one step (the model answers it with text
at once) that any worker runs while the parent waits parked. CPU is counted per step of the
bench's turns (the parent's): the worker's (which runs the child turn too), and the worker's
with the tool service's (which runs the tool call in the first).
"""

from __future__ import annotations

from typing import Any

from tests.bench.load import Window
from tests.bench.report import median, ratio, table
from tests.bench.targets import LoopwireTarget
from tests.bench.workload import SUB_AGENT

HELPER = {"name": SUB_AGENT, "system_prompt": "You answer arithmetic.", "tools": []}


def _per_parent_step(window: Window) -> tuple[float, float]:
    """Worker CPU, and worker plus helpers' CPU, in ms per step of the driven turns."""
    steps = window.steps - window.finals
    if steps <= 0:
        return float("nan"), float("nan")
    others = sum(v for k, v in window.other_cpu_s.items() if k != "model")
    return 1000 * window.worker_cpu_s / steps, 1000 * (window.worker_cpu_s + others) / steps


def _targets(ctx: Any, variants: dict[str, dict[str, Any]]) -> list[LoopwireTarget]:
    """loopwire as the step scenario runs it, then one target per variant (its options)."""
    plan = ctx.plan
    common: dict[str, Any] = {
        "prefetch": plan.prefetch,
        "steps": plan.steps,
        "agents_dir": ctx.agents_dir,
        "extra_env": {"LOOPWIRE_GRACE_S": "3"},
        "source": ctx.source,
    }
    targets = [LoopwireTarget(ctx.shared, ctx.model, **common)]
    for name, options in variants.items():
        env = {**common["extra_env"], **options.pop("env", {})}
        targets.append(
            LoopwireTarget(
                ctx.shared, ctx.model, **{**common, "extra_env": env}, variant=name, **options
            )
        )
    return targets


async def _measured(ctx: Any, targets: list[LoopwireTarget]) -> dict[str, list[Window]]:
    """A window of each target per round, in alternating order, one target at a time (they
    all consume the same turn queue)."""
    plan = ctx.plan
    await ctx.model.configure(delay=0)
    windows: dict[str, list[Window]] = {t.name: [] for t in targets}
    for r in range(plan.rounds):
        for target in targets if r % 2 == 0 else list(reversed(targets)):
            target.profile_dir = ctx.profile_dir
            try:
                await target.start(1)
                window = await ctx.driver.measure(
                    target,
                    sessions=plan.step_sessions[0],
                    warmup_s=plan.step_warmup_s,
                    window_s=plan.step_window_s,
                )
            finally:
                target.stop()
                target.workers, target.helpers = [], []
            windows[target.name].append(window)
    return windows


async def _compared(ctx: Any, title: str, variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each variant's CPU per step against loopwire as the step scenario runs it."""
    targets = _targets(ctx, variants)
    windows = await _measured(ctx, targets)
    base = median([w.cpu_ms_per_step for w in windows[targets[0].name]])
    out: dict[str, Any] = {}
    rows = []
    for name, found in windows.items():
        cpu = median([w.cpu_ms_per_step for w in found])
        out[name] = {
            "cpu_ms_per_step": cpu,
            "ratio": ratio(cpu, base),
            "rounds": [w.as_dict() for w in found],
        }
        rows.append((name, cpu, ratio(cpu, base), [round(w.cpu_ms_per_step, 2) for w in found]))
    ctx.tables.append(
        table(
            f"{title}, {ctx.plan.step_sessions[0]} sessions",
            ("system", "cpu ms/step", "vs loopwire", "per round"),
            rows,
        )
    )
    return out


async def events(ctx: Any) -> dict[str, Any]:
    """The default event types (loopwire), none published, and every type (the model events
    too: two more publishes a step)."""
    return await _compared(
        ctx,
        "Event types published (loopwire: the default set)",
        {
            "events-off": {"env": {"LOOPWIRE_EVENTS": "[]"}},
            "events-all": {"env": {"LOOPWIRE_EVENTS": '["*"]'}},
        },
    )


async def tracing(ctx: Any) -> dict[str, Any]:
    """Tracing on (every turn sampled, exported over OTLP/HTTP to a sink in the model server's
    control process) against off (loopwire: no ``OTEL_*``)."""
    return await _compared(
        ctx,
        "Tracing (loopwire: off)",
        {
            "tracing-on": {
                "env": {
                    "OTEL_EXPORTER_OTLP_ENDPOINT": ctx.model.control,
                    "OTEL_SERVICE_NAME": "loopwire-bench",
                }
            }
        },
    )


STREAMED_CHARS = 1200
"""About 300 output tokens a step."""


async def streaming(ctx: Any) -> dict[str, Any]:
    """Every step's answer carries about 300 tokens of text besides its tool call, streamed
    (message.delta events, coalesced as configured) against the same answers not streamed
    (loopwire)."""
    await ctx.model.configure(delay=0, content_chars=STREAMED_CHARS)
    try:
        return await _compared(
            ctx,
            f"Streaming, answers of {STREAMED_CHARS} characters (loopwire: not streamed)",
            {"streaming": {"agent_extra": {"stream": True}}},
        )
    finally:
        await ctx.model.configure(delay=0, content_chars=0)


async def context(ctx: Any) -> dict[str, Any]:
    """A context budget never reached (every step estimates its request) and one that cuts the
    40-message history (about 5,000 tokens) to 2,000 on every step, against none."""
    return await _compared(
        ctx,
        "A context budget (loopwire: none)",
        {
            "context-unreached": {"agent_extra": {"context": {"max_tokens": 10**6}}},
            "context-window": {
                "agent_extra": {"context": {"max_tokens": 2000, "strategy": "window"}}
            },
        },
    )


async def subagent(ctx: Any) -> dict[str, Any]:
    sessions = ctx.plan.step_sessions[0]
    tool, child = _targets(
        ctx,
        {
            "subagent": {
                "agent_extra": {"tools": [], "agents": [SUB_AGENT]},
                "extra_agents": (HELPER,),
            }
        },
    )
    windows = await _measured(ctx, [tool, child])
    out: dict[str, Any] = {}
    rows = []
    base_worker = median([_per_parent_step(w)[0] for w in windows[tool.name]])
    base_all = median([_per_parent_step(w)[1] for w in windows[tool.name]])
    for name, found in windows.items():
        worker = median([_per_parent_step(w)[0] for w in found])
        total = median([_per_parent_step(w)[1] for w in found])
        out[name] = {
            "worker_cpu_ms_per_step": worker,
            "worker_and_helpers_cpu_ms_per_step": total,
            "ratio_worker": ratio(worker, base_worker),
            "ratio_all": ratio(total, base_all),
            "rounds": [w.as_dict() for w in found],
        }
        rows.append((name, worker, ratio(worker, base_worker), total, ratio(total, base_all)))
    ctx.tables.append(
        table(
            f"A step that calls a sub-agent against one that calls a tool, {sessions} sessions "
            "(CPU per step of the driven turns; the sub-agent's child turn is one model call)",
            ("system", "worker cpu ms/step", "vs tool", "+ tool service ms/step", "vs tool"),
            rows,
        )
    )
    return out
