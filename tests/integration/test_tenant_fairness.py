"""A tenant's cap on running turns (``LOOPWIRE_TENANTS__MAX_RUNNING``): the slots' scripts
against the real Redis, then a noisy neighbour over the real broker (tenant A's backlog does
not hold up tenant B's turn), a turn cancelled while it waits in line, and a worker killed
right after it gave a slot back."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis
from support_rpc import AMQP_URL, wait_until
from tenant_support import tenant_worker

from contracts import topology as t
from contracts.client import LoopwireClient
from harness import SURVIVOR_ENV, WorkerProcess, event_bindings, subscribed
from worker.session.tenant_slots import TenantSlots
from worker.testing.scripted_model import Reply, ScriptedModel
from worker.testing.slots import MemoryTenantSlots

pytestmark = pytest.mark.integration


@pytest.fixture(params=["redis", "memory"])
async def slots(
    redis: Redis, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[TenantSlots | MemoryTenantSlots, str]]:
    """The Redis scripts, and the simulation's double of them: one scenario for both."""
    tenant = f"t{uuid.uuid4().hex[:8]}"
    if request.param == "memory":
        yield MemoryTenantSlots(default_cap=2), tenant
        return
    yield TenantSlots(redis, default_cap=2), tenant
    async for key in redis.scan_iter(match=f"lw:tenant:{{{tenant}}}:*"):
        await redis.delete(key)


async def test_the_slots_hand_a_freed_one_to_the_first_in_line_once(
    slots: tuple[TenantSlots | MemoryTenantSlots, str],
) -> None:
    s, tenant = slots
    now = time.time()

    async def admit(turn: str) -> tuple[bool, list[tuple[str, str]]]:
        return await s.admit(tenant, turn, f"s-{turn}", now)

    assert await admit("t1") == (True, [])
    assert await admit("t2") == (True, [])
    assert await admit("t3") == (False, [])
    assert await admit("t4") == (False, [])
    assert await admit("t3") == (False, [])  # again (a redelivered first step): still in line
    assert await admit("t1") == (True, [])  # again: it holds its slot
    assert await s.release(tenant, "t1", now) == [("t3", "s-t3")]
    # the end repeated (its worker died before sending t3's first step): sent again
    assert await s.release(tenant, "t1", now) == [("t3", "s-t3")]
    assert await admit("t3") == (True, [])  # its first step: from now on it just runs
    assert await s.release(tenant, "t1", now) == []
    assert await admit("t5") == (False, [])  # behind t4
    assert await s.release(tenant, "t5", now) == []  # cancelled in line: out of it
    assert await s.release(tenant, "t2", now) == [("t4", "s-t4")]
    assert await admit("t4") == (True, [])
    assert await admit("t6") == (False, [])
    # slots whose turns never ended lapse: the first in line gets one, a newcomer the other
    assert await s.admit(tenant, "t7", "s-t7", now + 40 * 24 * 3600) == (
        True,
        [("t6", "s-t6")],
    )


CAPPED = {"LOOPWIRE_TENANTS__MAX_RUNNING": "2", "LOOPWIRE_PREFETCH": "64"}


class SlowModel:
    """Answers ``ok`` after ``delay`` s, counting acme's calls in flight at once."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.running = self.most = 0
        self.hold = asyncio.Event()
        self.hold.set()

    async def __call__(self, body: dict[str, Any]) -> Reply:
        text = str(body["messages"][-1].get("content"))
        if text.startswith("acme"):
            self.running += 1
            self.most = max(self.most, self.running)
            try:
                await asyncio.sleep(self.delay)
                await self.hold.wait()
            finally:
                self.running -= 1
        return Reply.text(f"done {text}")


@pytest.fixture
async def tenants(
    tenant_users: dict[str, str],
    topology: None,
    redis: Redis,
) -> AsyncIterator[dict[str, LoopwireClient]]:
    await forget_tenants(redis)  # a rate limit's state outlives a run by two minutes
    async with (
        LoopwireClient(tenant_users["acme"], tenant="acme") as acme,
        LoopwireClient(tenant_users["globex"], tenant="globex") as globex,
    ):
        yield {"acme": acme, "globex": globex}
    await forget_tenants(redis)


async def forget_tenants(redis: Redis) -> None:
    for tenant in ("acme", "globex"):
        for pattern in (
            f"lw:tenant:{{{tenant}}}:*",
            f"lw:{{{tenant}/*",
            f"lw:turn:{tenant}/*",
            f"lw:rate:{{tenant:{tenant}}}:*",
        ):
            async for key in redis.scan_iter(match=pattern):
                await redis.delete(key)


async def test_a_noisy_neighbours_backlog_does_not_hold_up_another_tenant(
    scripted_model: ScriptedModel,
    tenants: dict[str, LoopwireClient],
    tenant_users: dict[str, str],
    tmp_path: Path,
    uid: str,
) -> None:
    """acme publishes 60 turns at once, capped at 2 running; globex's one turn, published
    after them, is answered within a second or two while acme's backlog needs 6 s at least;
    every acme turn completes, never more than 2 at once."""
    model = SlowModel(0.2)
    scripted_model.respond_with(model)
    acme, globex = tenants["acme"], tenants["globex"]
    async with tenant_worker(scripted_model, tenant_users, tmp_path, **CAPPED) as process:
        handles = [
            await acme.start_turn("support", f"acme {i}", session_id=f"s-{uid}-{i}")
            for i in range(60)
        ]
        started = time.monotonic()
        answer = await globex.run_turn("support", "globex", session_id=f"s-{uid}-g", timeout=30)
        waited = time.monotonic() - started
        results = [await handle.result(120) for handle in handles]
        for handle in handles:
            await handle.close()
        assert process.errors() == []
    assert answer.content == "done globex"
    assert waited < 3.0, f"globex waited {waited:.1f}s behind acme's backlog"
    assert [r.content for r in results] == [f"done acme {i}" for i in range(60)]
    assert model.most == 2


@pytest.mark.timeout(240)
async def test_a_tenant_behind_a_thousand_queued_turns_of_another_starts_at_once(
    scripted_model: ScriptedModel,
    tenants: dict[str, LoopwireClient],
    tenant_users: dict[str, str],
    tmp_path: Path,
    uid: str,
) -> None:
    """acme publishes 1,000 turns into its own intake queue while the model holds its calls,
    so none of them moves; globex's turn, published after them, is answered while all but
    the worker's prefetch of acme's are still queued: it did not wait for any of them. Then
    every acme turn completes."""
    model = SlowModel(0)
    model.hold.clear()
    scripted_model.respond_with(model)
    acme, globex = tenants["acme"], tenants["globex"]
    prefetch = 8
    env = {"LOOPWIRE_PREFETCH": str(prefetch)}
    async with tenant_worker(scripted_model, tenant_users, tmp_path, **env) as process:
        handles = [
            await acme.start_turn("support", f"acme {i}", session_id=f"s-{uid}-{i}")
            for i in range(1000)
        ]
        await wait_until(lambda: model.running == prefetch, timeout=30)
        answer = await globex.run_turn("support", "globex", session_id=f"s-{uid}-g", timeout=30)
        queued = await queue_depth(t.intake_queue("acme"))
        model.hold.set()
        results = [await handle.result(180) for handle in handles]
        for handle in handles:
            await handle.close()
        assert process.errors() == []
    assert answer.content == "done globex"
    assert queued == 1000 - prefetch, f"{queued} of acme's turns were still queued"
    assert [r.content for r in results] == [f"done acme {i}" for i in range(1000)]


async def queue_depth(name: str) -> int:
    """The ready messages of a queue, as the broker counts them."""
    async with await aio_pika.connect(AMQP_URL) as connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, passive=True)
        return int(queue.declaration_result.message_count or 0)


async def test_a_turn_cancelled_in_line_ends_and_a_killed_worker_hands_its_slot_on(
    scripted_model: ScriptedModel,
    tenants: dict[str, LoopwireClient],
    tenant_users: dict[str, str],
    redis: Redis,
    tmp_path: Path,
    uid: str,
) -> None:
    """Cap 1 (globex's own limit): the first turn runs, the second waits in line and is
    cancelled there, the third waits; the worker dies right after the first turn's end gave
    its slot back; another worker repeats that end and the third turn runs."""
    model = SlowModel(0)
    model.hold.clear()
    scripted_model.respond_with(model)
    acme = tenants["acme"]
    limits = {"LOOPWIRE_TENANTS__LIMITS": json.dumps({"acme": {"max_running": 1}})}
    first = tenant_worker(
        scripted_model,
        tenant_users,
        tmp_path,
        LOOPWIRE_FAILPOINTS="tenant_slot_released",
        **CAPPED,
        **limits,
    )
    await first.start()
    try:
        running = await acme.start_turn("support", "acme running", session_id=f"s-{uid}-1")
        await scripted_model.wait_for_requests(1)
        waiting = await acme.start_turn("support", "acme waiting", session_id=f"s-{uid}-2")
        last = await acme.start_turn("support", "acme last", session_id=f"s-{uid}-3")

        async def in_line() -> bool:  # no event says so: the tenant's line in Redis does
            line = await redis.lrange("lw:tenant:{acme}:line", 0, -1)
            return [t.decode() for t in line] == [waiting.turn_id, last.turn_id]

        await wait_until(in_line)
        await acme.cancel(waiting.turn_id, "not needed")
        cancelled = await waiting.result(20)
        assert cancelled.finish_reason == "cancelled"
        assert len(scripted_model.requests) == 1  # still only the running turn asked
        model.hold.set()
        assert await first.exited() != 0  # died right after the slot was given back
    finally:
        first.kill()
    async with tenant_worker(
        scripted_model, tenant_users, tmp_path, **SURVIVOR_ENV, **CAPPED, **limits
    ) as second:
        done = await running.result(30)
        ended = await last.result(30)
        assert second.errors() == []
    for handle in (running, waiting, last):
        await handle.close()
    assert (done.content, ended.content) == ("done acme running", "done acme last")
    assert [str(r["messages"][-1]["content"]) for r in scripted_model.requests] == [
        "acme running",
        "acme last",
    ]


async def test_a_child_turn_stays_in_its_tenant_and_takes_no_slot(
    scripted_model: ScriptedModel,
    tenants: dict[str, LoopwireClient],
    tenant_users: dict[str, str],
    redis: Redis,
    tmp_path: Path,
    uid: str,
) -> None:
    """Cap 1: acme's turn calls a sub-agent; the child runs (its parent's slot is enough), in
    acme's keys, and acme's subscriber follows the whole tree within acme."""

    def answer(body: dict[str, Any]) -> Reply:
        if body["messages"][0]["content"] == "agent:researcher":
            return Reply.text("facts")
        if not any(m["role"] == "tool" for m in body["messages"]):
            return Reply.tool_calls(("researcher", {"input": "find"}))
        return Reply.text("done with " + body["messages"][-1]["content"])

    scripted_model.respond_with(answer)
    team = [
        {"name": "lead", "system_prompt": "agent:lead", "tools": [], "agents": ["researcher"]},
        {"name": "researcher", "system_prompt": "agent:researcher", "tools": []},
    ]
    acme = tenants["acme"]
    limits = {"LOOPWIRE_TENANTS__LIMITS": json.dumps({"acme": {"max_running": 1}})}
    root = f"t-{uid}-lead"
    tree: list[Any] = []

    async def follow() -> None:
        async for event in _until_done(acme.tree(root), root):
            tree.append(event)

    async with tenant_worker(scripted_model, tenant_users, tmp_path, *team, **limits) as w:
        before = await asyncio.to_thread(event_bindings, "acme.#")
        following = asyncio.create_task(follow())
        await subscribed("acme.#", before)  # bound within acme before anything runs
        handle = await acme.start_turn("lead", "go", session_id=f"s-{uid}", turn_id=root)
        result = await handle.result(30)
        await asyncio.wait_for(following, 20)
        await handle.close()
        assert w.errors() == []
    assert result.content == "done with facts"
    [child] = {e.session_id for e in tree if e.parent_turn_id == handle.turn_id}
    assert child != f"s-{uid}"
    assert await redis.exists(f"lw:{{acme/{child}}}:state")  # the child's session: acme's
    assert not await redis.exists(f"lw:{{{child}}}:state")
    assert any(e.type == "turn.completed" and e.session_id == child for e in tree)


async def _until_done(events: AsyncIterator[Any], root: str) -> AsyncIterator[Any]:
    async for event in events:
        yield event
        if event.type == "turn.completed" and event.turn_id == root:
            return


async def throttles(process: WorkerProcess) -> dict[str, float]:
    """The worker's ``loopwire_steps_throttled_total`` by reason."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{process.port}/metrics") as response,
    ):
        text = await response.text()
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "loopwire_steps_throttled_total"
    }


async def test_a_tenant_over_its_model_rate_limit_is_throttled_and_another_is_not(
    scripted_model: ScriptedModel,
    tenants: dict[str, LoopwireClient],
    tenant_users: dict[str, str],
    tmp_path: Path,
    redis: Redis,
    uid: str,
) -> None:
    """acme may make 2 model calls a minute: of its 3 turns, 2 are answered and the third
    parks as throttled (its slot 30 s away) until it is cancelled; globex, with no limit of
    its own, has all of its 5 turns answered meanwhile, and no rate-limit state in Redis."""
    calls: list[str] = []

    async def answer(body: dict[str, Any]) -> Reply:
        text = str(body["messages"][-1].get("content"))
        calls.append(text)
        return Reply.text(f"done {text}")

    scripted_model.respond_with(answer)
    acme, globex = tenants["acme"], tenants["globex"]
    limits = {"LOOPWIRE_TENANTS__LIMITS": json.dumps({"acme": {"requests_per_minute": 2}})}
    async with tenant_worker(scripted_model, tenant_users, tmp_path, **limits) as process:
        handles = [
            await acme.start_turn("support", f"acme {i}", session_id=f"s-{uid}-a{i}")
            for i in range(3)
        ]
        answers = [
            await globex.run_turn("support", f"globex {i}", session_id=f"s-{uid}-g{i}", timeout=30)
            for i in range(5)
        ]
        results = {h.turn_id: asyncio.ensure_future(h.result(60)) for h in handles}
        done, _ = await asyncio.wait(results.values(), timeout=5)
        assert [a.content for a in answers] == [f"done globex {i}" for i in range(5)]
        assert len(done) == 2, "acme's third turn waits for its slot"
        assert await throttles(process) == {"tenant_rate_limit": 1.0}
        assert await redis.exists("lw:rate:{tenant:acme}:requests") == 1
        assert await redis.exists("lw:rate:{tenant:globex}:requests") == 0
        [late] = [h for h in handles if not results[h.turn_id].done()]
        await late.cancel()
        cancelled = await results[late.turn_id]
        for handle in handles:
            await handle.close()
        assert process.errors() == []
    acme_calls = [c for c in calls if c.startswith("acme")]
    assert len(acme_calls) == 2
    assert sorted(r.result().content for r in done) == sorted(f"done {c}" for c in acme_calls)
    assert cancelled.finish_reason == "cancelled"
    assert sum(c.startswith("globex") for c in calls) == 5
