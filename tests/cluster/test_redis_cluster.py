"""loopwire on a Redis Cluster: three masters with one replica each (``redis_cluster``), real
worker subprocesses, real tool services (the SDK's server in this process, the notes example
as a subprocess), the scripted model, and the shared RabbitMQ in the suite's vhost.

What a user moving to a cluster needs to hold: turns with tool steps answer right, spread over
every master; a worker killed mid-turn is replaced without a second model call or tool run;
a tool runs once per call id; redaction keeps values from the model; a session's turns run in
arrival order; a session's erasure finds its keys on every master; and a manual failover of
the master that owns a running session's slot loses no turn, runs no tool twice and ends
every turn exactly once."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from pydantic import BaseModel, ConfigDict
from redis.asyncio import Redis
from redis.crc import key_slot
from support_rpc import RpcCaller

from contracts import keys
from contracts.client import LoopwireClient, TurnHandle, new_id
from contracts.registry import live_tools
from contracts.runtime.redis_client import redis_client
from contracts.topology import tool_queue
from contracts.turns import InputMessage, TurnRequest
from tests.cluster.redis_cluster import LocalRedisCluster, redis_cluster_fixture
from tests.integration.harness import (
    AMQP_URL,
    EventRecorder,
    WorkerProcess,
    assert_valid_transcript,
    reset_topology,
    run_past_a_crash,
    session_history,
    write_agents,
)
from tool_services.sdk import CallContext, ToolService
from tool_services.server import ToolServer
from tool_services.settings import Settings, ToolServiceSettings
from worker.session.store import RedisStore
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.cluster
__all__ = ["redis_cluster_fixture"]  # the fixture ``redis_cluster``, used by name

ROOT = Path(__file__).resolve().parents[2]


class LookupArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    q: str


class Lookup:
    """A search tool served by the SDK's ``ToolServer`` (its idempotency store on the cluster):
    counts how often it ran per idempotency key; ``delay_s`` keeps a call in flight."""

    def __init__(self, redis_url: str, delay_s: float = 0.0) -> None:
        self.name = f"lookup_{uuid.uuid4().hex[:8]}"
        self.executions: Counter[str] = Counter()
        self.arguments: list[str] = []
        self.delay_s = delay_s
        self.watch = "-"
        self.watched = asyncio.Event()
        """Set once a call's ``q`` starts with ``watch``."""
        service = ToolService(self.name)
        service.add_tool(self.run, name=self.name, description="Search the knowledge base.")
        self.server = ToolServer(
            service, Settings(amqp_url=AMQP_URL, redis_url=redis_url, tools=ToolServiceSettings())
        )

    async def run(self, args: LookupArgs, ctx: CallContext) -> dict[str, Any]:
        self.executions[ctx.idempotency_key] += 1
        self.arguments.append(args.q)
        if args.q.startswith(self.watch):
            self.watched.set()
        await asyncio.sleep(self.delay_s)
        return {"results": [f"found {args.q}"]}


@pytest.fixture
async def redis(redis_cluster: LocalRedisCluster) -> AsyncIterator[Redis]:
    client = redis_client(redis_cluster.url)
    yield client
    await client.aclose()


@pytest.fixture
async def client() -> AsyncIterator[LoopwireClient]:
    await reset_topology()
    async with LoopwireClient(AMQP_URL) as c:
        yield c


@pytest.fixture
async def lookup(redis_cluster: LocalRedisCluster) -> AsyncIterator[Lookup]:
    tool = Lookup(redis_cluster.url, delay_s=0.2)
    await tool.server.start()
    yield tool
    await tool.server.stop()
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(tool_queue(tool.name))


def echo_model(scripted_model: ScriptedModel, tool: str) -> None:
    """Each turn: one search for the user's words, then ``answer to <words>``."""

    def responder(request: dict[str, Any]) -> Reply:
        messages = request["messages"]
        last_user = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        if messages[-1]["role"] == "user":
            return Reply.tool_calls((tool, {"q": last_user}))
        return Reply.text(f"answer to {last_user}")

    scripted_model.respond_with(responder)


def spread_sessions(cluster: LocalRedisCluster, per_master: int) -> list[str]:
    """Session ids, ``per_master`` of them on each master, interleaved."""
    found: dict[int, list[str]] = defaultdict(list)
    while len(found) < cluster.masters or any(len(v) < per_master for v in found.values()):
        session = new_id()
        owner = found[cluster.master_of(keys.session_state(session))]
        if len(owner) < per_master:
            owner.append(session)
    return [s for batch in zip(*found.values(), strict=True) for s in batch]


@dataclass
class Fleet:
    workers: list[WorkerProcess]
    completed: EventRecorder
    """Every ``turn.completed`` event."""


@pytest.fixture
async def fleet(
    redis_cluster: LocalRedisCluster, scripted_model: ScriptedModel, lookup: Lookup, tmp_path: Path
) -> AsyncIterator[Fleet]:
    """Two workers on the cluster, the model answering each turn after one search."""
    echo_model(scripted_model, lookup.name)
    agents = write_agents(tmp_path / "agents.json", [lookup.name])
    workers = [
        WorkerProcess(
            model_url=scripted_model.base_url, agents_file=agents, redis_url=redis_cluster.url
        )
        for _ in range(2)
    ]
    recorder = EventRecorder("turn.completed.#")
    await recorder.start()
    try:
        await asyncio.gather(*(w.start() for w in workers))
        yield Fleet(workers, recorder)
    finally:
        for worker in workers:
            worker.close()
        await recorder.stop()


async def run_sessions(
    client: LoopwireClient, sessions: list[str], turns: int
) -> dict[str, list[TurnHandle]]:
    """``turns`` turns per session, each published once the one before was accepted."""
    handles: dict[str, list[TurnHandle]] = defaultdict(list)

    async def publish(session: str) -> None:
        for turn in range(turns):
            handle = await client.start_turn(
                "support", f"{session[:6]} q{turn}", session_id=session
            )
            handles[session].append(handle)
            await handle.accepted(30)

    await asyncio.gather(*(publish(s) for s in sessions))
    return handles


async def check_sessions(
    handles: dict[str, list[TurnHandle]],
    recorder: EventRecorder,
    cluster: LocalRedisCluster,
    *,
    copies: bool = False,
) -> None:
    """Every turn answered right and completed exactly once, each session's in arrival order,
    its history a valid transcript. ``copies``: a copy of a completion (same event id, as a
    redone step publishes it; subscribers drop it by ``ce-id``) is allowed."""
    results = {h.turn_id: await h.result(90) for hs in handles.values() for h in hs}
    await recorder.wait_for(lambda evs: len(evs) >= len(results), timeout=30)
    await asyncio.sleep(0.5)  # a second completion of a turn would arrive now
    for hs in handles.values():
        for h in hs:
            await h.close()
    assert all(r.finish_reason == "stop" for r in results.values())
    events = [e for e in recorder.events if e.session_id in handles]
    if copies:
        seen: set[str] = set()
        events = [e for e in events if not (e.id in seen or seen.add(e.id))]  # first of each id
    completed = [e.turn_id for e in events]
    assert sorted(completed) == sorted(results), "every turn completes exactly once"
    for session, hs in handles.items():
        order = [e.turn_id for e in events if e.session_id == session]
        assert order == [h.turn_id for h in hs], "turns of a session ran out of order"
        messages = await session_history(session, cluster.url)
        users = [m.content for m in messages if m.role == "user"]
        assert users == [f"{session[:6]} q{turn}" for turn in range(len(hs))]
        answers = [m.content for m in messages if m.role == "assistant" and m.content]
        assert answers == [f"answer to {u}" for u in users]
        assert_valid_transcript(messages)
        assert [results[h.turn_id].content for h in hs] == answers


async def test_turns_with_tool_steps_run_in_order_on_every_master(
    redis_cluster: LocalRedisCluster, fleet: Fleet, lookup: Lookup, client: LoopwireClient
) -> None:
    sessions = spread_sessions(redis_cluster, 3)
    handles = await run_sessions(client, sessions, 3)
    await check_sessions(handles, fleet.completed, redis_cluster)
    assert sum(lookup.executions.values()) == 27
    assert set(lookup.executions.values()) == {1}, "a tool ran twice"
    assert all(w.errors() == [] for w in fleet.workers)


@pytest.mark.parametrize("point", ["model_saved", "tool_dispatched", "step_saved"])
async def test_a_worker_killed_mid_turn_is_replaced_without_a_second_call(
    point: str,
    redis_cluster: LocalRedisCluster,
    scripted_model: ScriptedModel,
    lookup: Lookup,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refund"})))
    scripted_model.expect(Reply.text("Refunds take 5 days."))
    agents = write_agents(tmp_path / "agents.json", [lookup.name])
    session = new_id()
    result, survivor = await run_past_a_crash(
        client,
        scripted_model.base_url,
        agents,
        point,
        "support",
        "refund time?",
        redis_url=redis_cluster.url,
        session_id=session,
    )
    assert result.content == "Refunds take 5 days."
    assert list(lookup.executions.values()) == [1], "the tool ran twice"
    assert len(scripted_model.requests) == 2, "a saved model answer was asked for again"
    messages = await session_history(session, redis_cluster.url)
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert survivor.errors() == []


async def test_a_tool_runs_once_per_call_id(
    redis_cluster: LocalRedisCluster, lookup: Lookup, redis: Redis, tmp_path: Path
) -> None:
    """The same call delivered again (and twice at once) is answered from the stored reply;
    the notes example, a subprocess given one node and ``LOOPWIRE_REDIS_CLUSTER=true``, files
    one note for a call delivered twice."""
    seed = f"redis://127.0.0.1:{redis_cluster.ports[1]}"
    env = {**os.environ, "LOOPWIRE_AMQP_URL": AMQP_URL, "LOOPWIRE_REDIS_URL": seed}
    env["LOOPWIRE_REDIS_CLUSTER"] = "true"
    log = (tmp_path / "notes.log").open("wb")
    notes = subprocess.Popen(
        [sys.executable, "-m", "tool_services.notes"], env=env, stdout=log, stderr=log, cwd=ROOT
    )
    connection = await aio_pika.connect_robust(AMQP_URL)
    rpc = RpcCaller(connection)
    await rpc.start()
    try:
        async with asyncio.timeout(20):
            while "file_note" not in await live_tools(redis):
                assert notes.poll() is None, log.name
                await asyncio.sleep(0.05)
        search = RpcCaller.request(lookup.name, {"q": "refund"}, turn_id=new_id())
        first, second = await asyncio.gather(
            rpc.call(search), rpc.call(search, correlation_id="again")
        )
        third = await rpc.call(search, correlation_id="once more")
        session = new_id()
        note = RpcCaller.request(
            "file_note", {"text": "call back"}, turn_id=new_id(), session_id=session
        )
        filed = await rpc.call(note)
        refiled = await rpc.call(note, correlation_id="note again")
    finally:
        await rpc.close()
        await connection.close()
        notes.terminate()
        notes.wait(30)
        log.close()
    assert first.value == second.value == third.value == {"results": ["found refund"]}
    assert lookup.executions == {search.context.idempotency_key: 1}
    assert filed.status == refiled.status == "ok"
    assert filed.value == refiled.value
    assert await redis.llen(keys.session_notes(session)) == 1  # type: ignore[misc]


async def test_redaction_keeps_the_value_from_the_model(
    redis_cluster: LocalRedisCluster,
    scripted_model: ScriptedModel,
    lookup: Lookup,
    client: LoopwireClient,
    redis: Redis,
    tmp_path: Path,
) -> None:
    email = f"c.{uuid.uuid4().hex[:8]}@canary.example"
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "«EMAIL_1»"})))
    scripted_model.expect(Reply.text("Wrote to «EMAIL_1»."))
    agents = tmp_path / "agents.json"
    agent = {"name": "support", "tools": [lookup.name], "hooks": ["redact"]}
    agents.write_text(json.dumps({"agents": [agent]}))
    recorder = EventRecorder()
    await recorder.start()
    session = new_id()
    try:
        async with WorkerProcess(
            model_url=scripted_model.base_url, agents_file=agents, redis_url=redis_cluster.url
        ) as worker:
            result = await client.run_turn(
                "support", f"I am {email}", session_id=session, timeout=30
            )
    finally:
        await recorder.stop()
    assert result.content == f"Wrote to {email}."
    assert lookup.arguments == [email], "the tool gets the real value"
    assert email not in json.dumps(scripted_model.requests)
    assert email not in "".join(e.model_dump_json() for e in recorder.for_turn(result.turn_id))
    assert email not in worker.log_path.read_text(errors="replace")
    assert await redis.exists(keys.redaction_map(session)) == 1
    assert worker.errors() == []


async def test_erasing_a_session_finds_its_keys_on_every_master(
    redis_cluster: LocalRedisCluster,
    scripted_model: ScriptedModel,
    lookup: Lookup,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    echo_model(scripted_model, lookup.name)
    agents = write_agents(tmp_path / "agents.json", [lookup.name])
    session = new_id()
    home = redis_cluster.master_of(keys.session_state(session))
    turn_ids = [new_id() for _ in range(2)]
    while redis_cluster.master_of(keys.turn_session(turn_ids[0])) == home:
        turn_ids[0] = new_id()  # a key of its turns on another master than the session's
    async with WorkerProcess(
        model_url=scripted_model.base_url, agents_file=agents, redis_url=redis_cluster.url
    ) as worker:
        done = []
        for n, turn_id in enumerate(turn_ids):
            handle = await client.start_turn(
                "support", f"q{n}", session_id=session, turn_id=turn_id
            )
            done.append(await handle.result(30))
            await handle.close()
        before = leftovers(redis_cluster, session, [r.turn_id for r in done])
        deleted = await client.sessions.delete(session, by="test")
    after = leftovers(redis_cluster, session, [r.turn_id for r in done])
    masters = {redis_cluster.master_of(k) for k in before}
    assert len(masters) >= 2, f"the session's keys and its turns' keys sat on one master: {before}"
    fence = keys.session_fence(session)  # kept, expiring, so that tokens never go back
    assert deleted >= len(before) - 1  # (but the fence; and the lease the erasure held)
    assert after == [fence]
    assert worker.errors() == []


async def test_of_sessions_racing_for_one_turn_id_one_is_accepted(redis: Redis) -> None:
    """The turn's session index sits in another slot than the sessions' keys: it is claimed
    first, so exactly one session accepts the id and the others record nothing."""
    store = RedisStore(redis)
    assert store.cluster
    turn_id = new_id()
    requests = [
        TurnRequest(
            turn_id=turn_id,
            session_id=new_id(),
            agent="support",
            input=(InputMessage(content="hi"),),
        )
        for _ in range(8)
    ]
    accepted = await asyncio.gather(*(store.accept(r) for r in requests))
    statuses = [a.status for a in accepted]
    assert sorted(statuses) == ["in_use"] * 7 + ["start"]
    winner = requests[statuses.index("start")]
    assert await store.session_of(turn_id) == winner.session_id
    for r in requests:
        assert await store.head(r.session_id) == (turn_id if r is winner else None)
    assert (await store.accept(winner)).status == "pending"
    await redis.delete(keys.turn_session(turn_id))
    for key in (keys.session_turns, keys.session_requests, keys.session_queue):
        await redis.delete(key(winner.session_id))


def leftovers(cluster: LocalRedisCluster, session: str, turn_ids: list[str]) -> list[str]:
    """Every key of the session or of its turns, scanned on each master by ``redis-cli``."""
    found: list[str] = []
    for port in cluster.master_ports():
        for pattern in [f"*{{{session}}}*", *(f"*{t}*" for t in turn_ids)]:
            found += cluster.cli(port, "--scan", "--pattern", pattern).split()
    return sorted(set(found))


@pytest.mark.timeout(240)
async def test_a_master_failover_mid_run_loses_no_turn_and_runs_no_tool_twice(
    redis_cluster: LocalRedisCluster, fleet: Fleet, lookup: Lookup, client: LoopwireClient
) -> None:
    sessions = [new_id() for _ in range(6)]
    watched = keys.session_state(sessions[0])
    old_master = redis_cluster.master_of(watched)
    lookup.watch = sessions[0][:6]
    running = asyncio.create_task(run_sessions(client, sessions, 6))
    # once the watched session's first turn is in its tool call, fail its master over
    await asyncio.wait_for(lookup.watched.wait(), 30)
    new_master = await asyncio.to_thread(redis_cluster.failover, old_master)
    ran_before = sum(lookup.executions.values())
    handles = await running
    await asyncio.to_thread(redis_cluster.wait_healthy)
    await check_sessions(handles, fleet.completed, redis_cluster)
    assert ran_before < 30, "the failover came too late to be in the middle of the run"
    assert redis_cluster.master_of(watched) == new_master != old_master
    errors = [line for w in fleet.workers for line in w.errors()]
    assert errors == [], "the failover surfaced as an error"
    assert key_slot(watched.encode()) == key_slot(keys.session_lease(sessions[0]).encode())
    assert sum(lookup.executions.values()) == 36
    assert set(lookup.executions.values()) == {1}, "a tool ran twice"


@pytest.mark.timeout(240)
async def test_a_killed_master_is_replaced_and_every_turn_still_ends_once(
    redis_cluster: LocalRedisCluster, fleet: Fleet, lookup: Lookup, client: LoopwireClient
) -> None:
    """SIGKILL of the master that owns a running session's slot: its replica is promoted
    after the node timeout; meanwhile that session's steps fail as transient and wait in the
    retry queue, the other sessions carry on. Every turn ends once (a redone step may publish
    a copy of its completion, with the same event id), right and in order. A tool call whose
    record sat on the dead master is answered with the tool service's error meanwhile. (A
    crash may lose a write the master acknowledged, replication being asynchronous: how often
    a tool ran is checked only under a manual failover.)"""
    sessions = spread_sessions(redis_cluster, 2)
    watched = keys.session_state(sessions[0])
    doomed = redis_cluster.master_of(watched)
    heir = redis_cluster.replica_of(doomed)
    lookup.watch = sessions[0][:6]
    try:
        running = asyncio.create_task(run_sessions(client, sessions, 4))
        await asyncio.wait_for(lookup.watched.wait(), 30)
        await asyncio.to_thread(redis_cluster.kill, doomed)
        await asyncio.to_thread(redis_cluster.promoted, heir)
        handles = await running
        await check_sessions(handles, fleet.completed, redis_cluster, copies=True)
    finally:
        await asyncio.to_thread(redis_cluster.restart, doomed)
    assert redis_cluster.master_of(watched) == heir
    # a call whose idempotency record sat on the dead master while it was down is answered
    # with the tool service's error instead of running; every other call ran
    turns = {h.turn_id for hs in handles.values() for h in hs}
    ran = {key.split(":")[0] for key in lookup.executions}
    results = [
        m.content or ""
        for session in sessions
        for m in await session_history(session, redis_cluster.url)
        if m.role == "tool"
    ]
    refused = [r for r in results if "cannot reach its store" in r]
    assert len(results) == len(turns), "one tool result per turn"
    assert all("found" in r or r in refused for r in results)
    assert ran <= turns
    assert len(ran) + len(refused) >= len(turns), "a tool call neither ran nor was answered"


async def test_a_parked_turn_is_listed_by_the_cli_and_approved(
    redis_cluster: LocalRedisCluster,
    scripted_model: ScriptedModel,
    lookup: Lookup,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    """A call waiting for approval: the turn parks (its controls in the session's slot, the
    list of waiting calls a global key), ``loopwire approvals`` given one node and
    ``LOOPWIRE_REDIS_CLUSTER=true`` lists it, ``loopwire approve`` lets it run once."""
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refund 100"})))
    scripted_model.expect(Reply.text("Refunded."))
    agents = tmp_path / "agents.json"
    agent = {"name": "support", "tools": [lookup.name], "approval": [lookup.name]}
    agents.write_text(json.dumps({"agents": [agent]}))
    owner = redis_cluster.master_of(keys.approvals_waiting())
    seed = next(p for p in redis_cluster.ports if p != owner)  # a plain client would get MOVED
    env = {
        **os.environ,
        "LOOPWIRE_REDIS_URL": f"redis://127.0.0.1:{seed}",
        "LOOPWIRE_REDIS_CLUSTER": "true",
    }
    async with WorkerProcess(
        model_url=scripted_model.base_url, agents_file=agents, redis_url=redis_cluster.url
    ) as worker:
        handle = await client.start_turn("support", "refund me", session_id=new_id())
        requested = await asyncio.wait_for(anext(handle.approvals()), 20)
        listed = await asyncio.to_thread(loopwire, ["approvals", "--json"], env)
        call_id = requested.data.call_id  # type: ignore[union-attr]
        await asyncio.to_thread(
            loopwire, ["--amqp-url", AMQP_URL, "approve", handle.turn_id, call_id], env
        )
        result = await handle.result(30)
        await handle.close()
        after = await asyncio.to_thread(loopwire, ["approvals", "--json"], env)
    waiting = [json.loads(line) for line in listed.splitlines()]
    assert [(w["turn_id"], w["call_id"]) for w in waiting] == [(handle.turn_id, call_id)]
    assert after == ""
    assert result.content == "Refunded."
    assert list(lookup.executions.values()) == [1]
    assert worker.errors() == []


def loopwire(args: list[str], env: dict[str, str]) -> str:
    """``loopwire ARGS`` as a user runs it; its standard output."""
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        env=env,
        capture_output=True,
        check=True,
        timeout=30,
        text=True,
        cwd=ROOT,
    )
    return done.stdout
