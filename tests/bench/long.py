"""The ``long`` scenario: whether a step late in a long turn costs what an early one does.

``long_sessions`` turns (32) run at once, each of ``n`` steps (50; ``--long-steps`` gives
several, a curve), every step one call of the ``lookup`` tool (``tests.bench.lookup``) whose
result is ``size`` bytes (4 KB, and a second row with 16 KB: ``--long-results``), on a fresh
session with the 40-message history. The same turns are measured twice: over their steps 1-5
and over their steps ``n-4``-``n``, for loopwire and for the protocol floor
(``tests.bench.floor_protocol``, whose state is a few counters and whose steps' records go to a
list of the turn's, written once), one system at a time, in alternating order (reversed every
round).

The windows. The bench model server holds the turns' model requests at barriers
(``model_server``: a request for model call ``k`` of its turn waits until it is released): at
calls 1, 5, 6, ``n-4`` and ``n``. When every turn waits at a barrier the workers have nothing
left to do; the harness samples then and releases the barrier. A *step* ``k`` here is what the
workers do from the model's answer to call ``k`` until the turn's request for call ``k+1`` (the
tool call, the saves, the events, the next step's message, consuming it, taking the lease with
the state and the history, compiling and sending the request); for the last step, until the
turn's end (its result saved and sent) instead. Steps 1-5 are the window from barrier 1 to
barrier 6, steps ``n-4``-``n`` from barrier ``n-4`` to the last turn's end. The time turns
spend held at a barrier is in neither window (each window is the sum of the stretches from one
barrier's release to the next barrier's fill); a turn that reaches a barrier before the others
waits inside the window, but a worker waiting for the model does next to nothing. The turn's
start (its acceptance and first lease) is before the first window.

What is sampled, for every worker process of the system under test and, apart, its tool
service: CPU time from ``/proc`` (divided by the window's steps: sessions x 5); the bytes each
process sent to and received from Redis, from the kernel's counters of its TCP connections to
Redis (``ss -tinp``: ``bytes_sent``, ``bytes_received``), which is what Redis's ``INFO stats``
counts as ``total_net_input_bytes`` and ``total_net_output_bytes`` for those clients alone
(the server-wide ``INFO`` figures, which include the tool service's and any other client's
traffic, are in the JSON beside them); and at barriers 5 and ``n``, the size of every session's
stored state (``HSTRLEN`` of the state hash's ``s`` field), the median reported: the state as
it is while step 5 (step ``n``) waits for the model.

The target (DESIGN.md): loopwire's steps 46-50 of a 50-step turn cost at most 1.15x its steps
1-5, in worker CPU and in bytes written, judged as the other targets are (medians of at least
three alternated rounds), for each result size. The protocol floor's ratios are printed beside
loopwire's: what the protocol's own growth is (the history read with every lease, and the model
request, grow with the turn in both systems).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import shutil
import socket
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from contracts import keys
from contracts.turns import LoopLimits
from tests.bench import budget, floor_protocol, lookup
from tests.bench.procs import Proc, cpu_seconds, kernel_use
from tests.bench.report import median, ratio, table
from tests.bench.targets import FloorTarget, LoopwireTarget, Target
from tests.bench.workload import REDIS_CLUSTER, REDIS_URL, SYSTEM_PROMPT

WINDOW = 5
"""Steps per window."""
MIN_STEPS = 2 * WINDOW
"""The shortest turn whose two windows do not overlap."""
TARGET_SESSIONS = 32
"""The concurrency the late-versus-early target is judged at."""
MAX_RESULT_CHARS = 1_000_000
"""The bench agents' ``max_tool_result_chars``: a result is never truncated (the default,
16,000, would cut the 16 KB results)."""
WARMUP_STEPS = MIN_STEPS
"""The turns each system runs once before the first window (pools, imports)."""
SYSTEMS = ("protocol", "loopwire")
END = 0
"""The key of the sample taken when the last turn ended."""


def agent_name(steps: int) -> str:
    return f"bench_long_{steps}"


def runnable(steps: int) -> str:
    """Why turns of ``steps`` steps cannot run ('' when they can): the profile schema caps
    ``max_tool_iterations``."""
    if steps < MIN_STEPS:
        return f"turns of fewer than {MIN_STEPS} steps have no two separate windows"
    try:
        LoopLimits(max_tool_iterations=steps)
    except ValidationError:
        cap = LoopLimits.model_json_schema()["properties"]["max_tool_iterations"].get("maximum")
        return f"the profile schema caps max_tool_iterations at {cap}"
    return ""


class LongLoopwire(LoopwireTarget):
    """loopwire with one agent per turn length (``bench_long_<n>``: the ``lookup`` tool, ``n``
    iterations, results never truncated) and the bench's SDK lookup service."""

    def __init__(self, ctx: Any, lengths: list[int]) -> None:
        limits = {"max_tool_iterations": max(lengths), "max_tool_result_chars": MAX_RESULT_CHARS}
        agents = tuple(
            {
                "name": agent_name(n),
                "system_prompt": SYSTEM_PROMPT,
                "tools": [lookup.LOOKUP],
                "limits": {**limits, "max_tool_iterations": n},
            }
            for n in lengths
        )
        super().__init__(
            ctx.shared,
            ctx.model,
            prefetch=ctx.plan.prefetch,
            steps=lengths[0],
            agents_dir=ctx.agents_dir,
            extra_env={"LOOPWIRE_GRACE_S": "3"},
            source=ctx.source,
            variant="long",
            agent_extra={"tools": [lookup.LOOKUP], "limits": limits},
            extra_agents=agents,
        )
        self.name = "loopwire"

    def use(self, steps: int) -> None:
        self.steps = steps
        self.agent = agent_name(steps)

    async def start_helpers(self) -> None:
        await self.start_tool_service("lookup", "tests.bench.lookup_service", lookup.LOOKUP)


def _state_key(target: Target, session_id: str) -> str:
    if isinstance(target, LoopwireTarget):
        return keys.session_state(session_id)
    return floor_protocol.state_key(session_id, "state")


@dataclass(frozen=True)
class Sample:
    """What every process of a system had spent at one moment."""

    at: float
    cpu: dict[str, float]
    sys_cpu: dict[str, float]
    sent: dict[str, int]
    """Bytes each process sent to Redis (all its connections to it, open now)."""
    received: dict[str, int]
    server: tuple[int, int]
    """Redis's ``total_net_input_bytes`` and ``total_net_output_bytes`` (every client's)."""


_PID = re.compile(r"pid=(\d+)")
_SENT = re.compile(r"\bbytes_sent:(\d+)")
_RECEIVED = re.compile(r"\bbytes_received:(\d+)")


def _redis_address() -> tuple[str, int] | None:
    """The Redis server's IP address and port, or None when its traffic cannot be told apart
    by address (a cluster, a Unix socket) or ``ss`` is missing."""
    url = urllib.parse.urlsplit(REDIS_URL)
    if REDIS_CLUSTER or url.scheme not in ("redis", "rediss") or not url.hostname:
        return None
    if shutil.which("ss") is None:
        return None
    return socket.gethostbyname(url.hostname), url.port or 6379


async def redis_traffic(address: tuple[str, int] | None) -> dict[int, tuple[int, int]]:
    """Bytes sent to and received from Redis by each process, summed over its open TCP
    connections to it (the kernel's counters, read with ``ss``)."""
    if address is None:
        return {}
    proc = await asyncio.create_subprocess_exec(
        "ss",
        "-tinpH",
        "dst",
        f"{address[0]}:{address[1]}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await proc.communicate()
    return parse_ss(out.decode(errors="replace"))


def parse_ss(text: str) -> dict[int, tuple[int, int]]:
    """``ss -tinpH``'s report, summed per process: bytes sent, bytes received."""
    traffic: dict[int, tuple[int, int]] = {}
    record = ""
    for line in [*text.splitlines(), ""]:
        if line[:1].isspace():
            record += line
            continue
        sent, received = _SENT.search(record), _RECEIVED.search(record)
        for pid in {int(p) for p in _PID.findall(record)}:
            before = traffic.get(pid, (0, 0))
            traffic[pid] = (
                before[0] + (int(sent.group(1)) if sent else 0),
                before[1] + (int(received.group(1)) if received else 0),
            )
        record = line
    return traffic


class Sampler:
    def __init__(self, ctx: Any, target: Target) -> None:
        self.redis = ctx.shared.redis
        self.procs: list[Proc] = [*target.workers, *target.helpers]
        self.address = _redis_address()

    async def take(self) -> Sample:
        at = time.monotonic()
        cpu = {p.name: cpu_seconds(p.pid) for p in self.procs}
        sys_cpu = {p.name: kernel_use(p.pid)[0] for p in self.procs}
        traffic = await redis_traffic(self.address)
        info = await self.redis.info("stats")
        if "total_net_input_bytes" not in info:  # a cluster client answers per node
            info = {
                k: sum(node.get(k, 0) for node in info.values())
                for k in ("total_net_input_bytes", "total_net_output_bytes")
            }
        return Sample(
            at=at,
            cpu=cpu,
            sys_cpu=sys_cpu,
            sent={p.name: traffic.get(p.pid, (0, 0))[0] for p in self.procs},
            received={p.name: traffic.get(p.pid, (0, 0))[1] for p in self.procs},
            server=(int(info["total_net_input_bytes"]), int(info["total_net_output_bytes"])),
        )


def barriers(steps: int) -> list[int]:
    """The model calls the turns are held at: the windows' ends, and where the state is read."""
    return sorted({1, WINDOW, WINDOW + 1, steps - WINDOW + 1, steps})


@dataclass
class Batch:
    """One system's turns of one length: what their windows cost."""

    system: str
    steps: int
    sessions: int
    arrived: dict[int, Sample]
    released: dict[int, Sample]
    workers: list[str]
    helpers: list[str]
    state_bytes: dict[int, float]
    health: dict[str, int]
    traffic: bool = True
    """Whether the processes' own Redis traffic was measured (``ss``, one Redis server)."""

    def window(self, first: int, last: int) -> dict[str, float]:
        """Per step, from the release of barrier ``first`` to the fill of barrier ``last``
        (``END``: the last turn's end), without the time held at the barriers between."""
        points = [*sorted(self.released), END]
        span = points[points.index(first) : points.index(last) + 1]
        totals: dict[str, float] = {}
        for start, stop in itertools.pairwise(span):
            a, b = self.released[start], self.arrived[stop]
            for name, value in _delta(a, b, self.workers, self.helpers).items():
                totals[name] = totals.get(name, 0.0) + value
        steps = self.sessions * WINDOW
        if not self.traffic:
            for key in ("sent", "received", "tool_sent", "tool_received"):
                totals[key] = float("nan")
        return {
            "seconds": totals["seconds"],
            "worker_cpu_ms_per_step": 1000 * totals["cpu"] / steps,
            "worker_sys_cpu_ms_per_step": 1000 * totals["sys_cpu"] / steps,
            "written_bytes_per_step": totals["sent"] / steps,
            "read_bytes_per_step": totals["received"] / steps,
            "tool_cpu_ms_per_step": 1000 * totals["tool_cpu"] / steps,
            "tool_written_bytes_per_step": totals["tool_sent"] / steps,
            "tool_read_bytes_per_step": totals["tool_received"] / steps,
            "server_in_bytes_per_step": totals["server_in"] / steps,
            "server_out_bytes_per_step": totals["server_out"] / steps,
        }

    def early(self) -> dict[str, float]:
        return self.window(1, WINDOW + 1)

    def late(self) -> dict[str, float]:
        return self.window(self.steps - WINDOW + 1, END)

    def as_dict(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "steps": self.steps,
            "sessions": self.sessions,
            "early": self.early(),
            "late": self.late(),
            "state_bytes": {f"step_{k}": v for k, v in self.state_bytes.items()},
            "health": self.health,
        }


def _delta(a: Sample, b: Sample, workers: list[str], helpers: list[str]) -> dict[str, float]:
    return {
        "seconds": b.at - a.at,
        "cpu": sum(b.cpu[w] - a.cpu[w] for w in workers),
        "sys_cpu": sum(b.sys_cpu[w] - a.sys_cpu[w] for w in workers),
        "sent": sum(b.sent[w] - a.sent[w] for w in workers),
        "received": sum(b.received[w] - a.received[w] for w in workers),
        "tool_cpu": sum(b.cpu[h] - a.cpu[h] for h in helpers),
        "tool_sent": sum(b.sent[h] - a.sent[h] for h in helpers),
        "tool_received": sum(b.received[h] - a.received[h] for h in helpers),
        "server_in": b.server[0] - a.server[0],
        "server_out": b.server[1] - a.server[1],
    }


class TurnsFailed(RuntimeError):
    pass


async def _watch(target: Target, what: str) -> None:
    """Raise if a turn of ``target`` failed or one of its processes died."""
    for proc in [*target.workers, *target.helpers]:
        if not proc.alive():
            raise TurnsFailed(f"{target.name}: {proc.name} exited {what}:\n{proc.log()}")
    bad = {k: v for k, v in target.health().items() if k != "transient_retries" and v}
    if bad:
        logs = "\n".join(w.log(2000) for w in target.workers)
        raise TurnsFailed(f"{target.name}: turns failed {what}: {bad}; worker log:\n{logs}")


async def run_batch(ctx: Any, target: Target, steps: int, tag: str) -> Batch:
    """Start ``long_sessions`` turns of ``steps`` steps on ``target``; sample at every barrier
    and at the end."""
    plan = ctx.plan
    sessions = plan.long_sessions
    sampler = Sampler(ctx, target)
    points = barriers(steps)
    arrived: dict[int, Sample] = {}
    released: dict[int, Sample] = {}
    state_bytes: dict[int, float] = {}
    await ctx.model.barrier(points, sessions)
    try:
        ctx.driver.launch(target, sessions=sessions, tag=tag)
        for k in points:
            deadline = time.monotonic() + plan.long_timeout_s
            while not await ctx.model.barrier_full(k, 1.0):
                await _watch(target, f"before model call {k}")
                if time.monotonic() > deadline:
                    raise TurnsFailed(
                        f"{target.name}: not every turn reached model call {k} within "
                        f"{plan.long_timeout_s:g}s"
                    )
            arrived[k] = await sampler.take()
            if k in (WINDOW, steps):
                state_bytes[k] = await _state_size(ctx, target)
            released[k] = await sampler.take()
            await ctx.model.release(k)
        deadline = time.monotonic() + plan.long_timeout_s
        while not await ctx.driver.finished(1.0):
            await _watch(target, "before their end")
            if time.monotonic() > deadline:
                raise TurnsFailed(
                    f"{target.name}: {ctx.driver.started - ctx.driver.done} turns did not end "
                    f"within {plan.long_timeout_s:g}s"
                )
        arrived[END] = await sampler.take()
    finally:
        await ctx.model.barrier([], 0)
    await _watch(target, "at their end")
    await ctx.driver.forget(tag)
    return Batch(
        system=target.name,
        steps=steps,
        sessions=sessions,
        arrived=arrived,
        released=released,
        workers=[w.name for w in target.workers],
        helpers=[h.name for h in target.helpers],
        state_bytes=state_bytes,
        health=target.health(),
        traffic=sampler.address is not None,
    )


async def _state_size(ctx: Any, target: Target) -> float:
    """The median size of the turns' stored states (the state hash's ``s``), in bytes."""
    async with ctx.shared.redis.pipeline(transaction=False) as pipe:
        for session in ctx.driver.sessions:
            pipe.hstrlen(_state_key(target, session), "s")
        sizes = await pipe.execute()
    return float(median([float(s) for s in sizes]))


async def _warm_up(ctx: Any, target: Target, tag: str) -> None:
    """One batch of short turns without barriers: pools, imports and caches warm."""
    _use(target, WARMUP_STEPS)
    ctx.driver.launch(target, sessions=ctx.plan.long_sessions, tag=tag)
    deadline = time.monotonic() + ctx.plan.long_timeout_s
    while not await ctx.driver.finished(1.0):
        await _watch(target, "while warming up")
        if time.monotonic() > deadline:
            raise TurnsFailed(f"{target.name}: the warm-up turns did not end")
    await ctx.driver.forget(tag)


async def _measure(ctx: Any, lengths: list[int]) -> dict[tuple[int, int], dict[str, list[Batch]]]:
    """The batches of every turn length and result size, for both systems, round by round,
    the systems' order reversed every round."""
    plan = ctx.plan
    batches: dict[tuple[int, int], dict[str, list[Batch]]] = {
        (n, size): {name: [] for name in SYSTEMS} for n in lengths for size in plan.long_results
    }
    await ctx.model.configure(delay=0)
    protocol = FloorTarget(
        ctx.shared,
        ctx.model,
        prefetch=plan.prefetch,
        steps=lengths[0],
        protocol=True,
        env={floor_protocol.TOOL_ENV: lookup.LOOKUP},
    )
    loopwire = LongLoopwire(ctx, sorted({*lengths, WARMUP_STEPS}))
    systems: list[Target] = [protocol, loopwire]
    tags = iter(range(1, 10**6))
    try:
        for target in systems:
            target.profile_dir = ctx.profile_dir
            await target.start(1)
        await ctx.model.configure(
            delay=0, tool=(lookup.LOOKUP, lookup.arguments(plan.long_results[0]))
        )
        for target in systems:
            await _warm_up(ctx, target, f"L{next(tags)}-")
        for r in range(plan.rounds):
            for n, size in batches:
                await ctx.model.configure(delay=0, tool=(lookup.LOOKUP, lookup.arguments(size)))
                for target in systems if r % 2 == 0 else reversed(systems):
                    _use(target, n)
                    batch = await run_batch(ctx, target, n, f"L{next(tags)}-")
                    batches[(n, size)][target.name].append(batch)
    finally:
        protocol.stop()
        loopwire.stop()
        await ctx.model.configure(delay=0, tool=("calculate", {}))
    return batches


def _use(target: Target, steps: int) -> None:
    """The turns started from now on have ``steps`` steps."""
    if isinstance(target, LongLoopwire):
        target.use(steps)
    target.steps = steps


async def long(ctx: Any) -> dict[str, Any]:
    """Steps 1-5 against the last five steps of the same turns, loopwire and the protocol
    floor, for each turn length and tool result size."""
    plan = ctx.plan
    if _redis_address() is None:
        print(
            "[bench] long: the workers' own Redis traffic cannot be measured (needs `ss` and "
            "one Redis server, not a cluster or a socket): see the server-wide figures in the JSON",
            flush=True,
        )
    skipped = {n: runnable(n) for n in plan.long_steps}
    lengths = [n for n in plan.long_steps if not skipped[n]]
    for n, why in skipped.items():
        if why:
            print(f"[bench] long: {n}-step turns not run: {why}", flush=True)
    out: dict[str, Any] = {"skipped": {str(n): why for n, why in skipped.items() if why}}
    rows: list[tuple[Any, ...]] = []
    batches = await _measure(ctx, lengths) if lengths else {}
    for (n, size), found in batches.items():
        summary, judged = _summarize(n, size, found, plan.long_sessions)
        ctx.judged.extend(judged)
        out[f"steps_{n}_result_{size}"] = {
            "rounds": {name: [b.as_dict() for b in found[name]] for name in SYSTEMS},
            "median": summary,
            "targets": [j.as_dict() for j in judged],
        }
        rows.extend(_rows(n, size, summary, judged))
    judged_lengths = {budget.LATE_VS_EARLY_STEPS} & set(lengths)
    if not judged_lengths:
        for metric in ("worker CPU", "bytes written"):
            ctx.judged.append(
                budget.ratio_target(
                    _target_name(budget.LATE_VS_EARLY_STEPS, metric, None),
                    [],
                    [],
                    budget.LATE_VS_EARLY,
                    unmet=f"{budget.LATE_VS_EARLY_STEPS}-step turns not run",
                )
            )
    ctx.tables.append(
        table(
            f"Long turns: steps 1-5 against the last five steps of the same turns, "
            f"{plan.long_sessions} sessions at once, one lookup call a step (per step: worker "
            "CPU, bytes the worker wrote to and read from Redis; state: the stored state's size "
            f"at steps 5 and n; target loopwire's last five <= {budget.LATE_VS_EARLY:g}x its "
            f"first five at {budget.LATE_VS_EARLY_STEPS} steps, CPU and bytes written, judged on "
            f"medians of >= {budget.MIN_ROUNDS} alternated rounds)",
            (
                "steps",
                "result",
                "system",
                "window",
                "cpu ms/step",
                "KB written/step",
                "KB read/step",
                "state KB",
                "x first: cpu",
                "written",
                "read",
                "target: cpu",
                "target: written",
            ),
            rows,
        )
    )
    return out


def _target_name(steps: int, metric: str, size: int | None) -> str:
    of = f", {size // 1024} KB results" if size else ""
    return (
        f"loopwire steps {steps - WINDOW + 1}-{steps} <= {budget.LATE_VS_EARLY:g}x steps "
        f"1-{WINDOW}, {metric} per step{of}"
    )


METRICS = {
    "worker_cpu_ms_per_step": "worker CPU",
    "written_bytes_per_step": "bytes written",
}
"""The figures the target holds to the ratio (the key, and its name in the target)."""


def _summarize(
    n: int, size: int, found: dict[str, list[Batch]], sessions: int
) -> tuple[dict[str, Any], list[budget.Judged]]:
    summary: dict[str, Any] = {}
    judged: list[budget.Judged] = []
    for name, runs in found.items():
        early = [b.early() for b in runs]
        late = [b.late() for b in runs]
        s: dict[str, Any] = {
            "early": {k: median([w[k] for w in early]) for k in early[0]},
            "late": {k: median([w[k] for w in late]) for k in late[0]},
            "state_bytes": {
                f"step_{k}": median([b.state_bytes[k] for b in runs]) for k in (WINDOW, n)
            },
        }
        s["late_vs_early"] = {
            k: ratio(s["late"][k], s["early"][k])
            for k in ("worker_cpu_ms_per_step", "written_bytes_per_step", "read_bytes_per_step")
        }
        summary[name] = s
        if name != "loopwire" or n != budget.LATE_VS_EARLY_STEPS:
            continue
        unmet = "" if sessions == TARGET_SESSIONS else f"{sessions} sessions, not {TARGET_SESSIONS}"
        for key, metric in METRICS.items():
            judged.append(
                budget.ratio_target(
                    _target_name(n, metric, size),
                    [w[key] for w in late],
                    [w[key] for w in early],
                    budget.LATE_VS_EARLY,
                    unmet=unmet,
                )
            )
    return summary, judged


def _rows(
    n: int, size: int, summary: dict[str, Any], judged: list[budget.Judged]
) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    cells = [j.cell for j in judged] or ["-", "-"]
    for name in SYSTEMS:
        s = summary[name]
        for window, label, state_at in (
            ("early", f"1-{WINDOW}", WINDOW),
            ("late", f"{n - WINDOW + 1}-{n}", n),
        ):
            w = s[window]
            late = window == "late"
            ratios = s["late_vs_early"]
            rows.append(
                (
                    n,
                    f"{size // 1024} KB",
                    name,
                    label,
                    w["worker_cpu_ms_per_step"],
                    w["written_bytes_per_step"] / 1024,
                    w["read_bytes_per_step"] / 1024,
                    s["state_bytes"][f"step_{state_at}"] / 1024,
                    ratios["worker_cpu_ms_per_step"] if late else "-",
                    ratios["written_bytes_per_step"] if late else "-",
                    ratios["read_bytes_per_step"] if late else "-",
                    cells[0] if late and name == "loopwire" else "-",
                    cells[1] if late and name == "loopwire" else "-",
                )
            )
    return rows
