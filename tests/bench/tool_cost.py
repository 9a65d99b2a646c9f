"""The ``tool`` scenario: what a tool service spends per call, the SDK's calculator service
against the tool protocol floor (``tests.bench.tool_floor``) running the same function.

Both are fed the same requests by the same caller (loopwire's ``ToolRPC``, in the driver) at
the same fixed rate, one service at a time on the same queue, in alternating order (reversed
every round). Per round: a warm-up, then ``tool_rate * tool_window_s`` calls sent at that rate
(open loop: a slow service gets calls queued, not fewer calls); the service process's CPU
(``/proc``, as for the workers) over the window divided by the calls, the caller's CPU per call
and the round trip the caller sees.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import aio_pika

from contracts.tools import ToolCallRequest, ToolContext, ToolDefinition, idempotency_key
from tests.bench import budget
from tests.bench.procs import Proc
from tests.bench.report import median, ratio, table
from tests.bench.workload import AMQP_URL, TOOL, TOOL_ARGUMENTS, tool_definition
from worker.transport.rpc import ToolRPC

SYSTEMS = ("floor", "sdk")
EXPECTED = {"expression": TOOL_ARGUMENTS["expression"], "value": "42"}


def _requests(turn: str, n: int) -> list[ToolCallRequest]:
    deadline = time.time() + 120
    return [
        ToolCallRequest(
            call_id=f"call_{i}",
            tool=TOOL,
            arguments=TOOL_ARGUMENTS,
            context=ToolContext(
                session_id=turn,
                turn_id=turn,
                agent="bench",
                deadline=deadline,
                idempotency_key=idempotency_key(turn, f"call_{i}"),
            ),
        )
        for i in range(n)
    ]


async def _paced(
    rpc: ToolRPC, definition: ToolDefinition, requests: list[ToolCallRequest], rate: float
) -> tuple[list[float], int]:
    """Send ``requests`` at ``rate`` per second without waiting for replies; the round trip of
    each, and how many replies were wrong."""
    latencies: list[float] = []
    bad = 0

    async def one(request: ToolCallRequest) -> None:
        nonlocal bad
        started = time.perf_counter()
        reply = await rpc.call(request, definition)
        latencies.append(time.perf_counter() - started)
        if reply.status != "ok" or reply.value != EXPECTED:
            bad += 1

    loop = asyncio.get_running_loop()
    tasks = []
    t0 = loop.time()
    for i, request in enumerate(requests):
        delay = t0 + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    await asyncio.gather(*tasks)
    return latencies, bad


async def tool_round(
    rpc: ToolRPC, service: Proc, *, turn: str, rate: float, warmup_s: float, window_s: float
) -> dict[str, Any]:
    definition = ToolDefinition(
        name=TOOL,
        description=tool_definition()["function"]["description"],
        parameters=tool_definition()["function"]["parameters"],
    )
    _, bad_warm = await _paced(
        rpc, definition, _requests(f"{turn}w", max(1, int(rate * warmup_s))), rate
    )
    requests = _requests(turn, max(1, int(rate * window_s)))
    cpu0, caller0, wall0 = service.cpu(), time.process_time(), time.perf_counter()
    latencies, bad = await _paced(rpc, definition, requests, rate)
    cpu, caller = service.cpu() - cpu0, time.process_time() - caller0
    wall = time.perf_counter() - wall0
    latencies.sort()
    n = len(requests)
    return {
        "calls": n,
        "seconds": wall,
        "calls_per_s": n / wall,
        "service_cpu_ms_per_call": 1000 * cpu / n,
        "caller_cpu_ms_per_call": 1000 * caller / n,
        "p50_ms": 1000 * latencies[n // 2],
        "p99_ms": 1000 * latencies[min(n - 1, int(0.99 * n))],
        "health": {"bad_replies": bad + bad_warm},
    }


async def _start_floor() -> Proc:
    proc = Proc("tool-floor", ["-m", "tests.bench.tool_floor"])
    proc.start()

    async def consuming() -> bool:
        return "ready" in proc.log()

    await proc.wait_ready(consuming)
    return proc


async def tool(ctx: Any) -> dict[str, Any]:
    """CPU per call of the SDK's calculator service and of the tool protocol floor."""
    plan = ctx.plan
    _, loopwire = ctx.targets(prefetch=plan.prefetch)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in SYSTEMS}
    connection = await aio_pika.connect(AMQP_URL)
    try:
        rpc = ToolRPC(await connection.channel(publisher_confirms=True, on_return_raises=True))
        await rpc.start()
        for r in range(plan.rounds):
            for name in SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS)):
                await ctx.shared.purge_work()
                if name == "sdk":
                    await loopwire.start_helpers()
                    service = loopwire.helpers[0]
                else:
                    service = await _start_floor()
                try:
                    rounds[name].append(
                        await tool_round(
                            rpc,
                            service,
                            turn=f"b{ctx.run_id}-tool{r}{name}{uuid.uuid4().hex[:4]}",
                            rate=plan.tool_rate,
                            warmup_s=plan.tool_warmup_s,
                            window_s=plan.tool_window_s,
                        )
                    )
                finally:
                    service.stop()
                    service.remove_log()
                    loopwire.helpers = []
    finally:
        await connection.close()
    keys = ("service_cpu_ms_per_call", "caller_cpu_ms_per_call", "p50_ms", "p99_ms", "calls_per_s")
    summary = {name: {k: median([x[k] for x in rounds[name]]) for k in keys} for name in SYSTEMS}
    judged = budget.ratio_target(
        f"SDK tool service <= {budget.TOOL_VS_FLOOR:g}x tool protocol floor, CPU per call",
        [x["service_cpu_ms_per_call"] for x in rounds["sdk"]],
        [x["service_cpu_ms_per_call"] for x in rounds["floor"]],
        budget.TOOL_VS_FLOOR,
    )
    ctx.judged.append(judged)
    floor_cpu = summary["floor"]["service_cpu_ms_per_call"]
    rows = []
    for name in SYSTEMS:
        s = summary[name]
        rows.append(
            (
                {"floor": "tool protocol floor", "sdk": "SDK service (calculator)"}[name],
                s["service_cpu_ms_per_call"],
                ratio(s["service_cpu_ms_per_call"], floor_cpu),
                s["caller_cpu_ms_per_call"],
                s["p50_ms"],
                s["p99_ms"],
                s["calls_per_s"],
                [round(x["service_cpu_ms_per_call"], 3) for x in rounds[name]],
                judged.cell if name == "sdk" else "-",
            )
        )
    ctx.tables.append(
        table(
            f"Tool service: CPU per call at {plan.tool_rate:g} calls/s, the same requests from "
            f"loopwire's ToolRPC (claim, run the calculator, store, reply; target SDK <= "
            f"{budget.TOOL_VS_FLOOR:g}x the tool protocol floor, judged on medians of >= "
            f"{budget.MIN_ROUNDS} alternated rounds)",
            (
                "system",
                "service cpu ms/call",
                "x floor",
                "caller cpu ms/call",
                "round trip p50 ms",
                "p99 ms",
                "calls/s",
                "per round",
                "target",
            ),
            rows,
        )
    )
    return {"rounds": rounds, "median": summary, "target": judged.as_dict()}
