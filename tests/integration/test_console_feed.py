"""The console's index of turns (gateway/console): kept from the events through the gateways'
shared queue, so that events published while no gateway runs are indexed when one starts; a
row's status never goes back whatever order events arrive in; an event nobody can read is
dropped without stopping the feed."""

from __future__ import annotations

import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import pytest
from gateway_support import GatewayProcess
from redis.asyncio import Redis
from support_rpc import AMQP_URL, wait_until

from contracts import topology as t
from contracts.client import LoopwireClient
from contracts.codec import encode
from contracts.events import (
    ApprovalRequested,
    Event,
    ToolInvoking,
    TurnFinished,
    TurnStarted,
    TurnThrottled,
)
from contracts.turns import TurnResult
from gateway.console.index import Index
from harness import WorkerProcess
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration


async def rows(gateway: GatewayProcess, key: str) -> dict[str, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{gateway.url}/console/rows", headers={"x-api-key": key}) as response,
    ):
        assert response.status == 200
        return {r["turn_id"]: r for r in await response.json()}


async def test_a_turn_that_ran_while_no_gateway_did_is_listed_when_one_starts(
    scripted_model: ScriptedModel, topology: None, tmp_path: Path, redis: Redis
) -> None:
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps({"agents": [{"name": "support", "tools": []}]}))
    worker = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    async with worker, GatewayProcess(agents, {"ops": None}) as first:
        key = first.keys["ops"]
        first.stop(signal.SIGKILL)  # the queue it declared stays, and fills
        client = LoopwireClient(AMQP_URL)
        await client.connect()
        try:
            scripted_model.expect(Reply.text("while nobody watched"))
            handle = await client.start_turn("support", "hi")
            await handle.result(timeout=20)
        finally:
            await client.close()
        async with GatewayProcess(agents, {}, replica_of=first) as second:
            await wait_until(lambda: _done(second, key, handle.turn_id), timeout=20)
            row = (await rows(second, key))[handle.turn_id]
            assert (row["agent"], row["finish_reason"], row["step"]) == ("support", "stop", 0)
        assert worker.errors() == []
    async for found in redis.scan_iter(match="lw:console:*"):
        await redis.delete(found)


async def _done(gateway: GatewayProcess, key: str, turn_id: str) -> bool:
    return (await rows(gateway, key)).get(turn_id, {}).get("status") == "done"


async def test_an_event_nobody_can_read_is_dropped_and_the_feed_goes_on(
    topology: None, tmp_path: Path, redis: Redis
) -> None:
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps({"agents": [{"name": "support", "tools": []}]}))
    turn_id = f"t-{uuid.uuid4().hex[:10]}"
    async with GatewayProcess(agents, {"ops": None}) as gateway:
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel()
            exchange = await channel.get_exchange(t.EVENTS_EXCHANGE)
            await exchange.publish(
                aio_pika.Message(b"\xc1 not msgpack"), routing_key=f"turn.started.support.{turn_id}"
            )
            event = _event(
                "turn.started",
                turn_id,
                time.time(),
                TurnStarted(history_len=0, max_tool_iterations=7),
            )
            await exchange.publish(aio_pika.Message(encode(event)), routing_key=event.routing_key)
        key = gateway.keys["ops"]
        await wait_until(lambda: _running(gateway, key, turn_id), timeout=20)
        assert "cannot read" in gateway.log()
    async for found in redis.scan_iter(match="lw:console:*"):
        await redis.delete(found)


async def _running(gateway: GatewayProcess, key: str, turn_id: str) -> bool:
    return (await rows(gateway, key)).get(turn_id, {}).get("status") == "running"


def _event(kind: str, turn_id: str, at: float, data: Any, step: int | None = 0) -> Event:
    return Event(
        id=f"{kind}-{turn_id}-{at}",
        type=kind,  # type: ignore[arg-type]
        time=at,
        agent="support",
        turn_id=turn_id,
        session_id="s1",
        step=step,
        data=data,
    )


async def test_a_rows_status_goes_by_rank_then_time_and_an_end_is_final(redis: Redis) -> None:
    """Events from several replicas arrive in any order: a later wait overrides running, an
    earlier running does not override a later wait, nothing overrides the end; a duplicate
    event shows once in the turn's timeline."""
    index = Index(redis, ttl_s=600, keep=10)
    tenant = f"t{uuid.uuid4().hex[:8]}"
    turn_id = "turn-1"
    now = time.time()
    started = _event(
        "turn.started", turn_id, now, TurnStarted(history_len=0, max_tool_iterations=7)
    )
    parked = _event(
        "approval.requested",
        turn_id,
        now + 2,
        ApprovalRequested(call_id="c1", tool="refund", arguments="{}"),
    )
    invoking = _event("tool.invoking", turn_id, now + 1, ToolInvoking(tool="refund", call_id="c1"))
    row = await index.apply(tenant, parked)
    assert row is not None and (row.status, row.waiting) == ("parked", "approval")
    row = await index.apply(tenant, started)
    assert row is not None and row.status == "parked" and row.created_at == now
    row = await index.apply(tenant, invoking)  # earlier than the wait: the wait stands
    assert row is not None and row.status == "parked"
    result = TurnResult(
        turn_id=turn_id,
        session_id="s1",
        agent="support",
        content="ok",
        finish_reason="stop",
        steps=1,
        duration_s=1.0,
        completed_at=now + 3,
    )
    done = _event("turn.completed", turn_id, now + 3, TurnFinished(result=result))
    row = await index.apply(tenant, done)
    assert row is not None and (row.status, row.finish_reason, row.waiting) == ("done", "stop", "")
    late = _event("turn.throttled", turn_id, now + 9, TurnThrottled(until=now + 10))
    row = await index.apply(tenant, late)
    assert row is not None and row.status == "done"
    await index.apply(tenant, parked)  # a duplicate (a redelivered step announces again)
    kinds = [e["type"] for e in await index.events(tenant, turn_id)]
    assert kinds == [
        "turn.started",
        "tool.invoking",
        "approval.requested",
        "turn.completed",
        "turn.throttled",
    ]
    assert [r.turn_id for r in await index.rows(tenant, 5)] == [turn_id]
    async for found in redis.scan_iter(match=f"lw:console:{{{tenant}}}*"):
        await redis.delete(found)


async def test_the_editors_check_says_what_is_wrong_and_refuses_a_body_it_cannot_read(
    topology: None, tmp_path: Path
) -> None:
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps({"agents": [{"name": "support", "tools": []}]}))
    async with (
        GatewayProcess(agents, {"ops": None}) as gateway,
        aiohttp.ClientSession(headers={"x-api-key": gateway.keys["ops"]}) as http,
    ):
        url = f"{gateway.url}/console/approvals/check"
        async with http.post(url, data=b"not json") as refused:
            assert refused.status == 422
        body = {"tool": "lookup", "arguments": "{not json"}
        async with http.post(url, json=body) as checked:
            assert checked.status == 200
            [problem] = (await checked.json())["problems"]
            assert problem.startswith("the arguments are not JSON")
        async with http.post(url, json={"tool": "lookup", "arguments": "[1]"}) as checked:
            assert (await checked.json())["problems"] == ["the arguments must be a JSON object"]
