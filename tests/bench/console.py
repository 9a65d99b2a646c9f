"""``--scenario console``: the operator console with a full list, over the real broker and Redis.

One loopwire worker (the bench model answering at once) and one gateway with the console on
(``loopwire gateway serve``), its shared queue of events emptied first.

- **Keeping up**: ``Plan.console_turns`` turns (one model call each, a session each) are
  published at ``Plan.console_rate`` a second while a client reads the live feed
  (``GET /console/live``, server-sent events). For each turn, the lag from its end (its row's
  ``updated_at``) to its row reading ``done`` on the feed: p50, p99, and how many never came
  (target: none missing, p99 under a second at 50 turns a second).
- **Pages with a full list**: then each page is fetched ``PAGE_TRIES`` times, one at a time:
  the list (all ``console_turns`` rows rendered), the list as JSON, a turn's timeline (its
  session reads), the approvals inbox and the dead letters. p50 and p99 of each (target: under
  300 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

import aio_pika
import aiohttp

from contracts import topology as t
from contracts.codec import encode
from contracts.turns import InputMessage, TurnRequest
from tests.bench.gateway import gateway_proc, one_call_target
from tests.bench.procs import http_ok
from tests.bench.report import table
from tests.bench.workload import AMQP_URL

AGENT = "bench_console"
PAGE_TRIES = 20
TARGET_PAGE_MS = 300.0
TARGET_LAG_P99_S = 1.0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def console(ctx: Any) -> dict[str, Any]:
    """The scenario (``ctx``: ``tests.bench.scenarios.Context``)."""
    plan = ctx.plan
    target = one_call_target(ctx, AGENT, "console")
    proc, url, key = gateway_proc(ctx, target.agents_file)
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        await (await connection.channel()).queue_delete(t.GATEWAY_CONSOLE_QUEUE)
    headers = {"x-api-key": key}
    try:
        await ctx.model.configure(delay=0)
        await target.add_worker()
        proc.start()
        await proc.wait_ready(lambda: http_ok(f"{url}/readyz"))
        async with aiohttp.ClientSession(base_url=url, headers=headers) as http:
            lag = await _keeping_up(http, plan.console_turns, plan.console_rate)
            pages = await _pages(http, lag["last_turn"])
    finally:
        proc.stop()
        target.stop()
        await ctx.shared.purge_work()
    return _report(ctx, plan, lag, pages)


async def _keeping_up(http: aiohttp.ClientSession, turns: int, rate: float) -> dict[str, Any]:
    """Turn requests published as any AMQP client does (no reply queue each, so that the
    publisher keeps the rate on a small machine); each row's lag is from the turn's end as its
    row says (``updated_at``: the worker's clock, the same machine's) to the feed showing it."""
    lags: dict[str, float] = {}
    published: list[str] = []
    ready, all_published, all_seen = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def check() -> None:
        if all_published.is_set() and set(published) <= set(lags):
            all_seen.set()

    async def feed() -> None:
        async with http.get("/console/live", timeout=aiohttp.ClientTimeout(total=None)) as live:
            kind = ""
            async for raw in live.content:
                line = raw.decode().strip()
                if line.startswith("event:"):
                    kind = line[6:].strip()
                    if kind == "ready":
                        ready.set()
                elif line.startswith("data:") and kind == "row":
                    row = json.loads(line[5:])["row"]
                    if row["status"] == "done" and row["turn_id"] not in lags:
                        lags[row["turn_id"]] = time.time() - row["updated_at"]
                        check()

    reader = asyncio.create_task(feed())
    connection = await aio_pika.connect(AMQP_URL)
    try:
        await asyncio.wait_for(ready.wait(), 10)
        channel = await connection.channel()
        sent: list[float] = []
        start = time.monotonic()
        for i in range(turns):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            turn_id = f"console-{uuid.uuid4().hex[:16]}"
            request = TurnRequest(
                turn_id=turn_id,
                session_id=turn_id,
                agent=AGENT,
                input=(InputMessage(content="hi"),),
            )
            await channel.default_exchange.publish(
                aio_pika.Message(
                    encode(request),
                    content_type="application/msgpack",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    message_id=turn_id,
                ),
                routing_key=t.TURNS_QUEUE,
            )
            published.append(turn_id)
            sent.append(time.monotonic())
        all_published.set()
        check()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_seen.wait(), 30)
    finally:
        await connection.close()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await reader
    took = [lags[turn] for turn in published if turn in lags]
    return {
        "turns": turns,
        "rate": rate,
        "achieved_rate": (turns - 1) / max(1e-9, sent[-1] - sent[0]),
        "missing": len(set(published) - set(lags)),
        "lag_p50_s": _pct(took, 0.5),
        "lag_p99_s": _pct(took, 0.99),
        "last_turn": published[-1],
    }


async def _pages(http: aiohttp.ClientSession, turn_id: str) -> dict[str, dict[str, float]]:
    pages = {
        "turns list (all rows)": "/console/",
        "turns list, JSON": "/console/rows",
        "a turn's timeline": f"/console/turns/{turn_id}",
        "approvals inbox": "/console/approvals",
        "dead letters": "/console/dead-letters",
    }
    out: dict[str, dict[str, float]] = {}
    for name, path in pages.items():
        took: list[float] = []
        for _ in range(PAGE_TRIES):
            begun = time.perf_counter()
            async with http.get(path, headers={"accept": "text/html"}) as page:
                assert page.status == 200, (path, page.status, await page.text())
                await page.read()
            took.append(1000 * (time.perf_counter() - begun))
        out[name] = {"p50_ms": _pct(took, 0.5), "p99_ms": _pct(took, 0.99)}
    return out


def _report(
    ctx: Any, plan: Any, lag: dict[str, Any], pages: dict[str, dict[str, float]]
) -> dict[str, Any]:
    worst = max(p["p99_ms"] for p in pages.values())
    page_verdict = "holds" if worst < TARGET_PAGE_MS else "missed"
    keeps_up = lag["missing"] == 0 and lag["lag_p99_s"] <= TARGET_LAG_P99_S
    lag_verdict = "holds" if keeps_up else "missed"
    ctx.tables.append(
        table(
            f"Console, live list: {lag['turns']} turns started at {lag['rate']:g}/s "
            f"(published at {lag['achieved_rate']:.1f}/s), each one model call answered at once",
            ("missing", "lag p50 s", "lag p99 s", "target"),
            [
                (
                    lag["missing"],
                    lag["lag_p50_s"],
                    lag["lag_p99_s"],
                    f"none missing, p99 <= {TARGET_LAG_P99_S:g} s: {lag_verdict}",
                )
            ],
        )
    )
    ctx.tables.append(
        table(
            f"Console pages with {plan.console_turns} turns in the list, {PAGE_TRIES} fetches each",
            ("page", "p50 ms", "p99 ms", "target"),
            [
                (name, p["p50_ms"], p["p99_ms"], f"< {TARGET_PAGE_MS:g} ms")
                for name, p in pages.items()
            ]
            + [("worst", "", worst, page_verdict)],
        )
    )
    return {
        "live": {k: v for k, v in lag.items() if k != "last_turn"},
        "pages": pages,
        "target": {"page_ms": TARGET_PAGE_MS, "pages": page_verdict, "live": lag_verdict},
    }
