"""The benchmark's scenarios. Each alternates floor and loopwire runs (ABBA order) under the
same load and reports medians and the loopwire / floor ratio of the medians."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.bench import budget, micro
from tests.bench.composed import context, events, streaming, subagent, tracing
from tests.bench.console import console
from tests.bench.controls_micro import unused_controls
from tests.bench.gateway import gateway
from tests.bench.held import VARIANTS as HELD_VARIANTS
from tests.bench.load import Driver, Window
from tests.bench.long import long
from tests.bench.procs import ROOT
from tests.bench.report import median, ratio, table
from tests.bench.targets import FloorTarget, LoopwireTarget, ModelServer, Shared, Target
from tests.bench.tenants import tenants
from tests.bench.tool_cost import tool


@dataclass(frozen=True)
class Plan:
    rounds: int
    adapter_calls: int
    adapter_concurrency: tuple[int, ...]
    rpc_calls: int
    rpc_concurrency: tuple[int, ...]
    step_sessions: tuple[int, ...]
    step_warmup_s: float
    step_window_s: float
    conc_sessions: int
    conc_delay_s: float
    conc_warmup_s: float
    conc_window_s: float
    conc_rounds: int
    hold_delay_s: float
    scale_sessions: int
    held_calls: int
    steps: int = 5
    prefetch: int = 300
    tool_rate: float = 200
    """Tool calls a second in the ``tool`` scenario."""
    tool_warmup_s: float = 2
    tool_window_s: float = 10
    long_sessions: int = 32
    """Turns at once in the ``long`` scenario."""
    long_steps: tuple[int, ...] = (50,)
    """Turn lengths of the ``long`` scenario (``--long-steps``: a curve)."""
    long_results: tuple[int, ...] = (4096, 16384)
    """Tool result sizes of the ``long`` scenario, in bytes (``--long-results``)."""
    long_timeout_s: float = 300
    """How long the ``long`` scenario waits for its turns to reach a barrier or end."""
    tenant_backlogs: tuple[int, ...] = (0, 100, 1000)
    """Tenant A's turns published at once before tenant B's one (``tenants`` scenario)."""
    tenant_cap: int = 8
    """``LOOPWIRE_TENANTS__MAX_RUNNING`` of the ``tenants`` scenario."""
    tenant_delay_s: float = 0.2
    """The model's answer delay in the ``tenants`` scenario."""
    gateway_runs: int = 200
    """Runs each way (AMQP, HTTP) in the ``gateway`` scenario."""
    gateway_streams: int = 1000
    """Streams open at once in the ``gateway`` scenario."""
    console_turns: int = 1000
    """Turns in the ``console`` scenario's list (started at ``console_rate`` a second)."""
    console_rate: float = 50.0


FULL = Plan(
    rounds=3,
    adapter_calls=400,
    adapter_concurrency=(1, 32, 256),
    rpc_calls=600,
    rpc_concurrency=(1, 32),
    step_sessions=(32, 256),
    step_warmup_s=4,
    step_window_s=15,
    conc_sessions=2000,
    conc_delay_s=2.0,
    conc_warmup_s=8,
    conc_window_s=20,
    conc_rounds=3,
    hold_delay_s=100,
    scale_sessions=256,
    held_calls=1000,
)
QUICK = Plan(
    rounds=1,
    adapter_calls=80,
    adapter_concurrency=(32,),
    rpc_calls=100,
    rpc_concurrency=(32,),
    step_sessions=(32,),
    step_warmup_s=1.5,
    step_window_s=2.5,
    conc_sessions=300,
    conc_delay_s=1.0,
    conc_warmup_s=2.5,
    conc_window_s=2.5,
    conc_rounds=1,
    hold_delay_s=40,
    scale_sessions=32,
    held_calls=200,
    tool_warmup_s=1,
    tool_window_s=3,
    long_sessions=4,
    long_steps=(12,),
    long_results=(4096,),
    long_timeout_s=120,
    tenant_backlogs=(0, 100),
    gateway_runs=30,
    gateway_streams=100,
    console_turns=100,
    tenant_delay_s=0.1,
)


@dataclass
class Context:
    plan: Plan
    shared: Shared
    model: ModelServer
    driver: Driver
    run_id: str
    profile_dir: Path | None = None
    source: Path | None = None
    agents_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="lw-bench-")))
    tables: list[str] = field(default_factory=list)
    judged: list[budget.Judged] = field(default_factory=list)
    """The performance budget's targets, judged on this run's figures."""

    def targets(
        self, *, prefetch: int, extra_env: dict[str, str] | None = None
    ) -> tuple[FloorTarget, LoopwireTarget]:
        floor = FloorTarget(self.shared, self.model, prefetch=prefetch, steps=self.plan.steps)
        loopwire = LoopwireTarget(
            self.shared,
            self.model,
            prefetch=prefetch,
            steps=self.plan.steps,
            agents_dir=self.agents_dir,
            extra_env={"LOOPWIRE_GRACE_S": "3", **(extra_env or {})},
            source=self.source,
        )
        for target in (floor, loopwire):
            target.profile_dir = self.profile_dir
        return floor, loopwire

    @contextlib.asynccontextmanager
    async def running(
        self,
        *,
        prefetch: int,
        extra_env: dict[str, str] | None = None,
        helpers_only: bool = False,
    ) -> AsyncIterator[tuple[FloorTarget, LoopwireTarget]]:
        """Both targets started (a worker each, or only their tool services), and stopped
        afterwards with the model answering at once again."""
        floor, loopwire = self.targets(prefetch=prefetch, extra_env=extra_env)
        try:
            for target in (floor, loopwire):
                await (target.start_helpers() if helpers_only else target.start(1))
            yield floor, loopwire
        finally:
            await self.model.configure(delay=0)
            floor.stop()
            loopwire.stop()


def _order(round_no: int, floor: Target, loopwire: Target) -> tuple[Target, Target]:
    return (floor, loopwire) if round_no % 2 == 0 else (loopwire, floor)


async def adapter(ctx: Context) -> dict[str, Any]:
    """The model call alone, on each client path (see ``micro.ADAPTER_VARIANTS``)."""
    plan = ctx.plan
    await ctx.model.configure(delay=0)
    out: dict[str, Any] = {}
    rows = []
    for concurrency in plan.adapter_concurrency:
        rounds = []
        for _ in range(plan.rounds):
            rounds.append(
                await micro.adapter_round(ctx.model, n=plan.adapter_calls, concurrency=concurrency)
            )
        summary = {
            name: {
                key: median([r[name][key] for r in rounds])
                for key in ("cpu_ms", "p50_ms", "p99_ms")
            }
            for name in micro.ADAPTER_VARIANTS
        }
        floor_cpu = summary["plain_aiohttp"]["cpu_ms"]
        for name, s in summary.items():
            s["x_plain_aiohttp"] = ratio(s["cpu_ms"], floor_cpu)
            rows.append((concurrency, name, s["cpu_ms"], s["x_plain_aiohttp"], s["p50_ms"]))
        out[f"concurrency_{concurrency}"] = {"rounds": rounds, "median": summary}
    ctx.tables.append(
        table(
            "Model call: client CPU per call (median of rounds)",
            ("conc", "variant", "cpu ms", "x plain aiohttp", "p50 ms"),
            rows,
        )
    )
    held = {variant: await _held(ctx.model, plan.held_calls, variant) for variant in HELD_VARIANTS}
    out["held"] = held
    plain = held["plain_aiohttp"]["kb_per_call"]
    ctx.tables.append(
        table(
            f"Model call held in flight: client memory per call ({plan.held_calls} calls, "
            "RSS growth, body bytes shared)",
            ("variant", "KB/call", "x plain aiohttp"),
            [(name, h["kb_per_call"], ratio(h["kb_per_call"], plain)) for name, h in held.items()],
        )
    )
    return out


async def _held(model: ModelServer, calls: int, variant: str) -> dict[str, Any]:
    """``tests.bench.held`` in a process of its own (one per variant)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.bench.held",
        model.base_url,
        model.control,
        str(calls),
        variant,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    if proc.returncode != 0:
        raise RuntimeError(f"tests.bench.held {variant} failed: {err.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def rpc(ctx: Context) -> dict[str, Any]:
    """One tool call round trip: loopwire's ToolRPC + SDK service vs raw aio-pika RPC."""
    plan = ctx.plan
    out: dict[str, Any] = {}
    rows: list[tuple[Any, ...]] = []
    async with ctx.running(prefetch=plan.prefetch, helpers_only=True) as (floor, loopwire):
        for concurrency in plan.rpc_concurrency:
            rounds = [
                await micro.rpc_round(
                    calculator=loopwire.helpers[0],
                    raw_tool=floor.helpers[0],
                    run_id=ctx.run_id,
                    n=plan.rpc_calls,
                    concurrency=concurrency,
                )
                for _ in range(plan.rounds)
            ]
            summary = {
                name: {
                    key: median([r[name][key] for r in rounds])
                    for key in ("cpu_ms", "service_cpu_ms", "p50_ms", "p99_ms")
                }
                for name in ("raw", "loopwire")
            }
            lw, raw = summary["loopwire"], summary["raw"]
            summary["ratio"] = {
                "caller_cpu": ratio(lw["cpu_ms"], raw["cpu_ms"]),
                "all_cpu": ratio(
                    lw["cpu_ms"] + lw["service_cpu_ms"], raw["cpu_ms"] + raw["service_cpu_ms"]
                ),
                "p50_latency": ratio(lw["p50_ms"], raw["p50_ms"]),
            }
            for name in ("raw", "loopwire"):
                s = summary[name]
                rows.append(
                    (concurrency, name, s["cpu_ms"], s["service_cpu_ms"], s["p50_ms"], s["p99_ms"])
                )
            r = summary["ratio"]
            rows.append(
                (
                    concurrency,
                    "ratio",
                    r["caller_cpu"],
                    "-",
                    r["p50_latency"],
                    f"all {r['all_cpu']:.2f}",
                )
            )
            out[f"concurrency_{concurrency}"] = {"rounds": rounds, "median": summary}
    ctx.tables.append(
        table(
            "Tool RPC round trip (median of rounds)",
            ("conc", "who", "caller cpu ms", "service cpu ms", "p50 ms", "p99 ms"),
            rows,
        )
    )
    return out


def _summarize(windows: dict[str, list[Window]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, ws in windows.items():
        summary[name] = {
            "worker_cpu_ms_per_step": median([w.cpu_ms_per_step for w in ws]),
            "worker_sys_cpu_ms_per_step": median(
                [1000 * w.worker_sys_cpu_s / w.steps if w.steps else float("nan") for w in ws]
            ),
            "steps_per_s": median([w.steps_per_s for w in ws]),
            "outside_model_p50_ms": median([1000 * w.gaps.get("p50", float("nan")) for w in ws]),
            "outside_model_p99_ms": median([1000 * w.gaps.get("p99", float("nan")) for w in ws]),
        }
    if "floor" in summary and "loopwire" in summary:
        lw, fl = summary["loopwire"], summary["floor"]
        pairs = zip(windows["loopwire"], windows["floor"], strict=False)
        summary["ratio"] = {
            "cpu_per_step": ratio(lw["worker_cpu_ms_per_step"], fl["worker_cpu_ms_per_step"]),
            "cpu_per_step_per_round": [
                ratio(a.cpu_ms_per_step, b.cpu_ms_per_step) for a, b in pairs
            ],
            "steps_per_s": ratio(lw["steps_per_s"], fl["steps_per_s"]),
        }
        if "protocol" in summary:
            pr = summary["protocol"]["worker_cpu_ms_per_step"]
            summary["ratio"]["protocol_cpu_per_step"] = ratio(pr, fl["worker_cpu_ms_per_step"])
            summary["ratio"]["cpu_per_step_vs_protocol"] = ratio(lw["worker_cpu_ms_per_step"], pr)
    return summary


async def step_cost(ctx: Context) -> dict[str, Any]:
    """Worker CPU per step at each session count: the floor, the protocol floor and loopwire,
    in alternating order."""
    plan = ctx.plan
    await ctx.model.configure(delay=0)
    out: dict[str, Any] = {}
    rows = []
    protocol = FloorTarget(
        ctx.shared, ctx.model, prefetch=plan.prefetch, steps=plan.steps, protocol=True
    )
    protocol.profile_dir = ctx.profile_dir
    async with ctx.running(prefetch=plan.prefetch) as (floor, loopwire):
        try:
            await protocol.start(1)
            for sessions in plan.step_sessions:
                windows: dict[str, list[Window]] = {"floor": [], "protocol": [], "loopwire": []}
                for r in range(plan.rounds):
                    order: list[Target] = [floor, protocol, loopwire]
                    for target in order if r % 2 == 0 else reversed(order):
                        window = await ctx.driver.measure(
                            target,
                            sessions=sessions,
                            warmup_s=plan.step_warmup_s,
                            window_s=plan.step_window_s,
                        )
                        windows[target.name].append(window)
                summary = _summarize(windows)
                judged = budget.ratio_target(
                    f"loopwire <= {budget.STEP_VS_PROTOCOL:g}x protocol floor, worker CPU per "
                    f"step, {sessions} sessions",
                    [w.cpu_ms_per_step for w in windows["loopwire"]],
                    [w.cpu_ms_per_step for w in windows["protocol"]],
                    budget.STEP_VS_PROTOCOL,
                )
                ctx.judged.append(judged)
                out[f"sessions_{sessions}"] = {
                    "rounds": {k: [w.as_dict() for w in v] for k, v in windows.items()},
                    "median": summary,
                    "target": judged.as_dict(),
                }
                ratios = summary["ratio"]
                for name in ("floor", "protocol", "loopwire"):
                    s = summary[name]
                    rows.append(
                        (
                            sessions,
                            name,
                            s["worker_cpu_ms_per_step"],
                            s["worker_sys_cpu_ms_per_step"],
                            {
                                "floor": 1.0,
                                "protocol": ratios["protocol_cpu_per_step"],
                                "loopwire": ratios["cpu_per_step"],
                            }[name],
                            ratios["cpu_per_step_vs_protocol"] if name == "loopwire" else "-",
                            s["steps_per_s"],
                            s["outside_model_p50_ms"],
                            s["outside_model_p99_ms"],
                            judged.cell if name == "loopwire" else "-",
                        )
                    )
        finally:
            protocol.stop()
    for sessions in STEP_TARGET_SESSIONS:
        if sessions not in plan.step_sessions:
            ctx.judged.append(
                budget.ceiling_target(
                    f"loopwire <= {budget.STEP_VS_PROTOCOL:g}x protocol floor, worker CPU per "
                    f"step, {sessions} sessions",
                    [],
                    budget.STEP_VS_PROTOCOL,
                    unmet=f"{sessions} sessions not run",
                )
            )
    ctx.tables.append(
        table(
            f"Worker CPU per step ({plan.steps} steps/turn, 40-message history, 1 tool call/step;"
            f" target loopwire <= {budget.STEP_VS_PROTOCOL:g}x protocol floor, judged on medians"
            f" of >= {budget.MIN_ROUNDS} alternated rounds; protocol: the floor making every"
            " operation the design requires, model through the openai client)",
            (
                "sessions",
                "system",
                "cpu ms/step",
                "of it kernel",
                "x floor",
                "x protocol",
                "steps/s",
                "out p50 ms",
                "out p99 ms",
                "target",
            ),
            rows,
        )
    )
    return out


STEP_TARGET_SESSIONS = (32, 256)
"""The session counts the step target is set at."""


async def concurrency(ctx: Context) -> dict[str, Any]:
    """``conc_sessions`` turns in flight on one worker. Throughput: the model answers after
    ``conc_delay_s``; sustained steps/s and the time each step spends outside the model call.
    Memory: the model answers only after ``hold_delay_s``, so that every turn waits for it at
    once; RSS over the warmed-up idle worker, per turn waiting."""
    plan = ctx.plan
    sessions = plan.conc_sessions
    windows: dict[str, list[Window]] = {"floor": [], "loopwire": []}
    memory: dict[str, list[dict[str, float]]] = {"floor": [], "loopwire": []}
    baseline: dict[str, int] = {}

    async def restart(target: Target) -> None:
        await target.stop_workers()  # abort the turns in flight, start afresh
        await ctx.shared.purge_work()
        await target.add_worker()
        await ctx.driver.measure(target, sessions=8, warmup_s=0.5, window_s=0.1)
        baseline[target.name] = sum(w.rss() for w in target.workers)

    extra_env = {"LOOPWIRE_MODEL__MAX_CONNECTIONS": str(2 * sessions)}
    async with ctx.running(prefetch=sessions + 500, extra_env=extra_env) as (floor, loopwire):
        await ctx.model.configure(delay=0)
        for first in _order(0, floor, loopwire):  # warm up (imports, pools) before the baseline
            await ctx.driver.measure(first, sessions=8, warmup_s=0.5, window_s=0.1)
            baseline[first.name] = sum(w.rss() for w in first.workers)
        for r in range(plan.conc_rounds):
            await ctx.model.configure(delay=plan.conc_delay_s)
            for target in _order(r, floor, loopwire):
                window = await ctx.driver.measure(
                    target,
                    sessions=sessions,
                    warmup_s=plan.conc_warmup_s,
                    window_s=plan.conc_window_s,
                    drain=False,
                    rss_baseline=baseline[target.name],
                )
                windows[target.name].append(window)
                await ctx.model.configure(delay=0)
                await restart(target)
                await ctx.model.configure(delay=plan.conc_delay_s)
            await ctx.model.configure(delay=plan.hold_delay_s)
            for target in _order(r, floor, loopwire):
                memory[target.name].append(
                    await ctx.driver.hold(
                        target,
                        sessions=sessions,
                        baseline=baseline[target.name],
                        timeout_s=plan.hold_delay_s - 10,
                    )
                )
                await ctx.model.configure(delay=0)
                await restart(target)
                await ctx.model.configure(delay=plan.hold_delay_s)
    summary = _summarize(windows)
    rows: list[tuple[Any, ...]] = []
    for name in ("floor", "loopwire"):
        s = summary[name]
        s["kb_per_turn_waiting"] = median([m["kb_per_turn"] for m in memory[name]])
        s["turns_waiting"] = median([m["turns_waiting"] for m in memory[name]])
        rows.append(
            (
                name,
                s["steps_per_s"],
                s["outside_model_p50_ms"],
                s["outside_model_p99_ms"],
                s["worker_cpu_ms_per_step"],
                s["kb_per_turn_waiting"],
                s["turns_waiting"],
            )
        )
    summary["ratio"]["kb_per_turn"] = ratio(
        summary["loopwire"]["kb_per_turn_waiting"], summary["floor"]["kb_per_turn_waiting"]
    )
    at = budget.KB_PER_TURN_AT
    judged = budget.ceiling_target(
        f"loopwire memory per turn in flight <= {budget.KB_PER_TURN:g} KB at {at:,} turns",
        [m["kb_per_turn"] for m in memory["loopwire"]],
        budget.KB_PER_TURN,
        unmet="" if sessions == at else f"{sessions:,} turns in flight, not {at:,}",
    )
    ctx.judged.append(judged)
    rows = [(*row, judged.cell if row[0] == "loopwire" else "-") for row in rows]
    ctx.tables.append(
        table(
            f"Concurrency: {sessions} turns in flight on one worker; throughput with the model "
            f"answering after {plan.conc_delay_s:g}s, memory with all turns waiting for it "
            f"(target <= {budget.KB_PER_TURN:g} KB/turn at {at:,} turns, judged on the median of "
            f">= {budget.MIN_ROUNDS} alternated rounds)",
            (
                "system",
                "steps/s",
                "out p50 ms",
                "out p99 ms",
                "cpu ms/step",
                "KB/turn",
                "waiting",
                "target",
            ),
            rows,
        )
    )
    return {
        "rounds": {k: [w.as_dict() for w in v] for k, v in windows.items()},
        "memory": memory,
        "median": summary,
        "target": judged.as_dict(),
    }


async def scaling(ctx: Context) -> dict[str, Any]:
    """One worker versus two on the same load (throughput ratio), floor as the reference."""
    plan = ctx.plan
    sessions = plan.scale_sessions
    await ctx.model.configure(delay=0)
    out: dict[str, Any] = {}
    rows = []
    async with ctx.running(prefetch=plan.prefetch) as (floor, loopwire):
        results: dict[str, dict[int, list[Window]]] = {
            "floor": {1: [], 2: []},
            "loopwire": {1: [], 2: []},
        }
        for r in range(plan.rounds):
            for target in _order(r, floor, loopwire):
                counts = (1, 2) if r % 2 == 0 else (2, 1)
                for count in counts:
                    while len(target.workers) < count:
                        await target.add_worker()
                    while len(target.workers) > count:
                        proc = target.workers.pop()
                        proc.stop()
                        proc.remove_log()
                    window = await ctx.driver.measure(
                        target,
                        sessions=sessions,
                        warmup_s=plan.step_warmup_s,
                        window_s=plan.step_window_s,
                    )
                    results[target.name][count].append(window)
        for name, by_count in results.items():
            one = median([w.steps_per_s for w in by_count[1]])
            two = median([w.steps_per_s for w in by_count[2]])
            out[name] = {
                "steps_per_s_1_worker": one,
                "steps_per_s_2_workers": two,
                "ratio_2_to_1": ratio(two, one),
                "cpu_ms_per_step_1": median([w.cpu_ms_per_step for w in by_count[1]]),
                "cpu_ms_per_step_2": median([w.cpu_ms_per_step for w in by_count[2]]),
                "rounds": {str(k): [w.as_dict() for w in v] for k, v in by_count.items()},
            }
            rows.append((name, one, two, ratio(two, one)))
    ctx.tables.append(
        table(
            f"Scaling: one worker vs two, {sessions} sessions (2 vCPU shared with broker, Redis, "
            "model and tool service)",
            ("system", "1 worker steps/s", "2 workers steps/s", "ratio"),
            rows,
        )
    )
    return out


NEVER_SPENT = {
    "max_total_tokens": 10**12,
    "max_cost_usd": 10.0**9,
    "max_tool_calls": 10**6,
    "max_wall_s": 10.0**6,
}
CONTROL_VARIANTS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "budgets": (
        {"budget": NEVER_SPENT, "session_budget": NEVER_SPENT, "daily_budget": NEVER_SPENT},
        {
            "LOOPWIRE_PRICES": json.dumps(
                {"scripted-model": {"input_per_m": 1.0, "output_per_m": 2.0}}
            )
        },
    ),
    "rate_limit": (
        {},
        {
            "LOOPWIRE_MODEL__REQUESTS_PER_MINUTE": str(10**9),
            "LOOPWIRE_MODEL__TOKENS_PER_MINUTE": str(10**12),
        },
    ),
}
"""Turn controls in use but never reached: each is a row against loopwire with none in use
(the cancel check, which every step makes, is in all of them)."""


async def controls(ctx: Context) -> dict[str, Any]:
    """What the turn controls cost a step when configured (limits never reached), against
    loopwire with none configured, in alternating order at the first session count."""
    plan = ctx.plan
    sessions = plan.step_sessions[0]
    await ctx.model.configure(delay=0)
    base = LoopwireTarget(
        ctx.shared,
        ctx.model,
        prefetch=plan.prefetch,
        steps=plan.steps,
        agents_dir=ctx.agents_dir,
        extra_env={"LOOPWIRE_GRACE_S": "3"},
        source=ctx.source,
    )
    targets: list[LoopwireTarget] = [base]
    for variant, (agent_extra, env) in CONTROL_VARIANTS.items():
        targets.append(
            LoopwireTarget(
                ctx.shared,
                ctx.model,
                prefetch=plan.prefetch,
                steps=plan.steps,
                agents_dir=ctx.agents_dir,
                extra_env={"LOOPWIRE_GRACE_S": "3", **env},
                source=ctx.source,
                variant=variant,
                agent_extra=agent_extra,
            )
        )
    windows: dict[str, list[Window]] = {t.name: [] for t in targets}
    # one at a time: every worker consumes the same turn queue
    for r in range(plan.rounds):
        for target in targets if r % 2 == 0 else list(reversed(targets)):
            target.profile_dir = ctx.profile_dir
            try:
                await target.start(1)
                window = await ctx.driver.measure(
                    target,
                    sessions=sessions,
                    warmup_s=plan.step_warmup_s,
                    window_s=plan.step_window_s,
                )
            finally:
                target.stop()
                target.workers, target.helpers = [], []
            windows[target.name].append(window)
    out: dict[str, Any] = {}
    rows: list[tuple[str, Any, float, Any]] = []
    base_cpu = median([w.cpu_ms_per_step for w in windows[base.name]])
    for name, found in windows.items():
        cpu = median([w.cpu_ms_per_step for w in found])
        out[name] = {
            "cpu_ms_per_step": cpu,
            "ratio_to_none": ratio(cpu, base_cpu),
            "per_round": [w.cpu_ms_per_step for w in found],
        }
        rows.append((name, cpu, ratio(cpu, base_cpu), [round(w.cpu_ms_per_step, 2) for w in found]))
    micro_n = 300 if plan.rounds == 1 else 2000
    alone = await unused_controls(ctx.shared.redis, micro_n)
    out["unused_alone"] = alone
    base_us = base_cpu * 1000
    rows.append(
        (
            "unused, measured alone",
            round(alone["added_us_per_step"] / 1000, 4),
            ratio(base_us + alone["added_us_per_step"], base_us),
            f"checks {alone['checks_us_per_step']:.1f} us + lease script "
            f"{alone['lease_script_us_after']:.0f} vs {alone['lease_script_us_before']:.0f} us",
        )
    )
    ctx.tables.append(
        table(
            f"Turn controls configured but never reached, {sessions} sessions (loopwire: none "
            "configured; target < 1.03x for what every step pays)",
            ("system", "cpu ms/step", "vs none", "per round"),
            rows,
        )
    )
    return out


SCENARIOS = {
    "adapter": adapter,
    "rpc": rpc,
    "tool": tool,
    "step": step_cost,
    "long": long,
    "concurrency": concurrency,
    "scaling": scaling,
    "controls": controls,
    "subagent": subagent,
    "context": context,
    "events": events,
    "tracing": tracing,
    "streaming": streaming,
    "tenants": tenants,
    "gateway": gateway,
    "console": console,
}
NOT_QUICK = ("tool",)
"""Scenarios ``--quick`` leaves out unless named (``--scenario``)."""
