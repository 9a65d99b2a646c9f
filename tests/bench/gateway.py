"""``--scenario gateway``: what the HTTP gateway adds, over the real broker and Redis.

One loopwire worker, the bench model answering at once, and one gateway process
(``loopwire gateway serve``, an API key of its own, the console off: ``--scenario console``
measures it). Each turn is one model call (the agent
``bench_gateway`` has no tools) on a fresh session.

- **Latency added**: ``Plan.gateway_runs`` turns, one at a time, alternating between the
  publisher client over AMQP (``start_turn`` and the result: publish, wait for it; the clock
  stops with the result in hand, before the client lets go of the turn) and the gateway
  (``POST /runs/wait`` on a kept-alive connection: the gateway publishes, waits, reads the
  thread's messages for the answer's values, answers, then lets go of the turn). p50
  and p99 of each, and their differences: what the gateway adds to a run (target: p50 ≤ 2 ms).
- **Memory per open stream**: with the model holding every answer, ``Plan.gateway_streams``
  clients each open ``POST /runs/stream`` and read its first event (``metadata``); the
  gateway's resident memory before and with them all open, divided by the streams (target:
  ≤ 64 KB a stream).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from contracts.client import LoopwireClient
from gateway.http.keys import new_key
from tests.bench.procs import Proc, free_port, http_ok
from tests.bench.report import median, table
from tests.bench.targets import LoopwireTarget
from tests.bench.workload import AMQP_URL, REDIS_URL

AGENT = "bench_gateway"
TARGET_P50_MS = 2.0
TARGET_KB_PER_STREAM = 64.0


def one_call_target(ctx: Any, agent: str, variant: str) -> LoopwireTarget:
    """A loopwire target whose agent ``agent`` answers in one model call (no tools)."""
    return LoopwireTarget(
        ctx.shared,
        ctx.model,
        prefetch=ctx.plan.prefetch,
        steps=1,
        agents_dir=ctx.agents_dir,
        extra_env={"LOOPWIRE_GRACE_S": "3"},
        source=ctx.source,
        variant=variant,
        extra_agents=({"name": agent, "tools": []},),
    )


def gateway_proc(ctx: Any, agents_file: Path, **env: str) -> tuple[Proc, str, str]:
    """``loopwire gateway serve`` on a free port with a key of its own (not started): the
    process, its URL and the key."""
    key, entry = new_key("bench", None)
    keys_file = ctx.agents_dir / "gateway-keys.json"
    keys_file.write_text(json.dumps({"keys": [entry.model_dump(exclude_none=True)]}))
    port = free_port()
    proc = Proc(
        "loopwire-gateway",
        ["-m", "worker.cli", "gateway", "serve"],
        env={
            "LOOPWIRE_AMQP_URL": AMQP_URL,
            "LOOPWIRE_REDIS_URL": REDIS_URL,
            "LOOPWIRE_AGENTS_FILE": str(agents_file),
            "LOOPWIRE_GATEWAY__PORT": str(port),
            "LOOPWIRE_GATEWAY__KEYS_FILE": str(keys_file),
            **env,
        },
    )
    return proc, f"http://127.0.0.1:{port}", key


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def gateway(ctx: Any) -> dict[str, Any]:
    """The scenario (``ctx``: ``tests.bench.scenarios.Context``)."""
    plan = ctx.plan
    target = one_call_target(ctx, AGENT, "gateway")
    # the API alone: the console's feed (--scenario console) would index every event meanwhile
    proc, url, key = gateway_proc(ctx, target.agents_file, LOOPWIRE_GATEWAY__CONSOLE="false")
    headers = {"x-api-key": key}
    run = {"assistant_id": AGENT, "input": {"messages": ["hi"]}}
    try:
        await ctx.model.configure(delay=0)
        await target.add_worker()
        proc.start()
        await proc.wait_ready(lambda: http_ok(f"{url}/readyz"))
        async with (
            LoopwireClient(AMQP_URL) as client,
            aiohttp.ClientSession(base_url=url, headers=headers) as http,
        ):

            async def direct() -> float:
                started = time.perf_counter()
                handle = await client.start_turn(AGENT, "hi")
                result = await handle.result(30)
                took = time.perf_counter() - started  # the answer in hand
                await handle.close()
                assert result.finish_reason == "stop", result
                return took

            async def over_http() -> float:
                started = time.perf_counter()
                async with http.post("/runs/wait", json=run) as answer:
                    assert answer.status == 200, await answer.text()
                    await answer.read()
                return time.perf_counter() - started

            for _ in range(5):  # warm-up: imports, pools, the first tenant's client
                await direct()
                await over_http()
            amqp: list[float] = []
            gw: list[float] = []
            for i in range(plan.gateway_runs):
                first, second = (direct, over_http) if i % 2 == 0 else (over_http, direct)
                a, b = await first(), await second()
                amqp.append(a if first is direct else b)
                gw.append(b if first is direct else a)
            streams = await _open_streams(ctx, proc, url, headers, run, plan.gateway_streams)
    finally:
        await ctx.model.configure(delay=0)
        proc.stop()
        target.stop()
        await ctx.shared.purge_work()
    return _report(ctx, amqp, gw, streams)


async def _open_streams(
    ctx: Any, proc: Proc, url: str, headers: dict[str, str], run: dict[str, Any], n: int
) -> dict[str, float]:
    """``n`` streams open at once on runs the model holds; the gateway's memory for them."""
    await ctx.model.configure(delay=60)
    before = proc.rss()
    connector = aiohttp.TCPConnector(limit=0)
    opened = asyncio.Event()
    count = 0
    release = asyncio.Event()

    async with aiohttp.ClientSession(base_url=url, headers=headers, connector=connector) as http:

        async def one() -> None:
            nonlocal count
            body = {**run, "stream_mode": ["values"]}
            async with http.post("/runs/stream", json=body) as answer:
                assert answer.status == 200, await answer.text()
                while (await answer.content.readline()).strip():  # the metadata event
                    pass
                count += 1
                if count == n:
                    opened.set()
                await release.wait()

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        try:
            started = time.monotonic()
            await asyncio.wait_for(opened.wait(), 300)
            open_s = time.monotonic() - started
            await asyncio.sleep(1)
            during = proc.rss()
        finally:
            release.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "streams": n,
        "rss_before_mb": before / 2**20,
        "rss_open_mb": during / 2**20,
        "kb_per_stream": (during - before) / 1024 / n,
        "open_s": open_s,
    }


def _report(
    ctx: Any, amqp: list[float], gw: list[float], streams: dict[str, float]
) -> dict[str, Any]:
    def ms(values: list[float], q: float) -> float:
        return 1000 * _pct(values, q)

    added_p50 = 1000 * (median(gw) - median(amqp))
    added_p99 = ms(gw, 0.99) - ms(amqp, 0.99)
    kb = streams["kb_per_stream"]
    verdict_latency = "holds" if added_p50 <= TARGET_P50_MS else "missed"
    verdict_memory = "holds" if kb <= TARGET_KB_PER_STREAM else "missed"
    ctx.tables.append(
        table(
            f"HTTP gateway: {len(amqp)} runs each way, one at a time, alternated (a turn of one "
            "model call answered at once); then streams open at once on held runs",
            ("path", "p50 ms", "p99 ms", "target"),
            [
                ("AMQP, publisher client", ms(amqp, 0.5), ms(amqp, 0.99), "-"),
                ("HTTP, POST /runs/wait", ms(gw, 0.5), ms(gw, 0.99), "-"),
                (
                    "added by the gateway",
                    added_p50,
                    added_p99,
                    f"p50 {added_p50:.2f} <= {TARGET_P50_MS:g} ms: {verdict_latency}",
                ),
            ],
        )
    )
    ctx.tables.append(
        table(
            "HTTP gateway: memory with streams open",
            ("streams", "RSS before MB", "RSS open MB", "KB per stream", "opened in s", "target"),
            [
                (
                    int(streams["streams"]),
                    streams["rss_before_mb"],
                    streams["rss_open_mb"],
                    kb,
                    streams["open_s"],
                    f"{kb:.1f} <= {TARGET_KB_PER_STREAM:g} KB: {verdict_memory}",
                )
            ],
        )
    )
    return {
        "amqp_ms": {"p50": ms(amqp, 0.5), "p99": ms(amqp, 0.99)},
        "gateway_ms": {"p50": ms(gw, 0.5), "p99": ms(gw, 0.99)},
        "added_ms": {"p50": added_p50, "p99": added_p99},
        "streams": streams,
        "target": {
            "added_p50_ms": TARGET_P50_MS,
            "kb_per_stream": TARGET_KB_PER_STREAM,
            "latency": verdict_latency,
            "memory": verdict_memory,
        },
    }
