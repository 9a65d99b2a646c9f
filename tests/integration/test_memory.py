"""The memory tool service over the real store (PostgreSQL), the broker and the scripted
model's embeddings: recall finds what was remembered and not another scope's, two instances
share their memories, a killed instance loses nothing, a redone call remembers once, deleting
a session forgets its memories, and every change is announced without its text; two tenants'
scopes of the same ids are apart (their memories, their deletions, their events), and a table
from before tenants is the default tenant's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from redis.asyncio import Redis
from support_rpc import RpcCaller, announcements

from contracts import tenancy
from contracts.client import LoopwireClient, new_id
from harness import AMQP_URL as WORKER_AMQP_URL
from harness import EventRecorder, WorkerProcess
from tool_services.memory.store import MemoryStore
from worker.session.memories import SessionMemories
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration
DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


async def started(spawn: Any, redis: Redis, model: ScriptedModel) -> Any:
    env = {
        "LOOPWIRE_MEMORY__DATABASE_URL": DATABASE_URL,
        "LOOPWIRE_MEMORY__EMBEDDINGS_URL": model.base_url,
    }
    before = set(await announcements(redis))
    service = await spawn("tool_services.memory", tool="remember", env=env)
    for _ in range(200):  # its own announcement (a killed one's may still be there)
        fresh = [a for i, a in (await announcements(redis)).items() if i not in before]
        if any(a.service == "memory" for a in fresh):
            return service
        await asyncio.sleep(0.05)
    raise AssertionError("the memory service did not announce its tools")


async def call(
    caller: RpcCaller,
    tool: str,
    arguments: dict[str, Any],
    tenant: str | None = None,
    **context: Any,
) -> Any:
    """Call ``tool`` as a worker does for a turn of ``tenant`` (``None``: tenancy off)."""
    context.setdefault("turn_id", f"t-{uuid.uuid4().hex[:8]}")
    with tenancy.acting_for(tenant):  # its idempotency key within the tenant
        request = caller.request(tool, arguments, **context)
    request = request.model_copy(
        update={"context": request.context.model_copy(update={"tenant": tenant})}
    )
    reply = await caller.call(request, timeout=20, correlation_id=uuid.uuid4().hex)
    assert reply.status == "ok", reply.error
    return reply.value


async def query(sql: str, *args: Any) -> list[asyncpg.Record]:
    """The rows of one statement, straight from the store's database."""
    connection = await asyncpg.connect(DATABASE_URL)
    try:
        return list(await connection.fetch(sql, *args))
    finally:
        await connection.close()


async def test_recall_finds_its_scopes_memories_across_instances_and_a_kill(
    spawn: Any,
    redis: Redis,
    caller: RpcCaller,
    scripted_model: ScriptedModel,
    events: EventRecorder,
) -> None:
    first = await started(spawn, redis, scripted_model)
    session, other, user = new_id(), new_id(), f"u-{new_id()}"  # the table outlives tests
    remembered = await call(
        caller,
        "remember",
        {"text": "the customer prefers invoices by post", "tags": ["billing"]},
        session_id=session,
    )
    await call(caller, "remember", {"text": "the customer's dog is called Rex"}, session_id=session)
    await call(caller, "remember", {"text": "invoices by email please"}, session_id=other)
    await call(
        caller,
        "remember",
        {"text": "prefers invoices in euros", "scope": "user"},
        session_id=other,
        metadata={"user_id": user},
    )
    # a second instance, then the first killed: the memories are in the store they share
    second = await started(spawn, redis, scripted_model)
    first.signal(signal.SIGKILL)
    await first.wait()
    found = await call(
        caller, "recall", {"query": "how does the customer want invoices"}, session_id=session
    )
    assert found["results"][0]["text"] == "the customer prefers invoices by post"
    assert {r["text"] for r in found["results"]} == {
        "the customer prefers invoices by post",
        "the customer's dog is called Rex",
    }, "another session's memory was recalled"
    by_user = await call(
        caller,
        "recall",
        {"query": "invoices", "scope": "user"},
        session_id=new_id(),
        metadata={"user_id": user},
    )
    assert [r["text"] for r in by_user["results"]] == ["prefers invoices in euros"]
    forgotten = await call(caller, "forget", {"id": remembered["id"]}, session_id=session)
    assert forgotten == {"forgotten": True, "id": remembered["id"]}
    again = await call(caller, "forget", {"id": remembered["id"]}, session_id=other)
    assert again["forgotten"] is False
    nothing = await call(caller, "recall", {"query": "zebra"}, session_id=new_id())
    assert nothing == {"results": []}
    await events.wait_for(lambda evs: sum(e.type == "memory.updated" for e in evs) >= 5)
    updates = [e for e in events.events if e.type == "memory.updated"]
    assert {(e.data.action) for e in updates} == {"remembered", "forgotten"}  # type: ignore[union-attr]
    assert "invoices" not in json.dumps([e.model_dump(mode="json") for e in updates])
    assert second.process.returncode is None


async def test_a_redone_call_remembers_once(
    spawn: Any, redis: Redis, caller: RpcCaller, scripted_model: ScriptedModel
) -> None:
    await started(spawn, redis, scripted_model)
    session = new_id()
    once = {"session_id": session, "turn_id": f"t-{new_id()}", "call_id": "call_same"}
    first = await call(caller, "remember", {"text": "only once"}, **once)
    second = await call(caller, "remember", {"text": "only once"}, **once)
    assert first["id"] == second["id"]
    count = await query(
        "SELECT count(*) FROM lw_memories WHERE scope = 'session' AND owner = $1", session
    )
    assert count[0][0] == 1


async def test_deleting_a_session_forgets_its_memories(
    spawn: Any,
    redis: Redis,
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    await started(spawn, redis, scripted_model)
    agents = tmp_path / "agents.json"
    agents.write_text(
        json.dumps({"agents": [{"name": "support", "tools": ["remember", "recall"]}]})
    )
    scripted_model.expect(Reply.tool_calls(("remember", {"text": "wants a callback at 5"})))
    scripted_model.expect(
        Reply.tool_calls(("remember", {"text": "is a user fact", "scope": "user"}))
    )
    scripted_model.expect(Reply.text("Noted."))
    session, user = new_id(), f"u-{new_id()}"
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents,
        extra_env={"LOOPWIRE_MEMORY__DATABASE_URL": DATABASE_URL},
    )
    async with worker:
        handle = await client.start_turn(
            "support", "remember this", session_id=session, metadata={"user_id": user}
        )
        assert (await handle.result(30)).content == "Noted."
        await handle.close()
        await client.sessions.delete(session)
    left = await query("SELECT scope, text FROM lw_memories WHERE owner = ANY($1)", [session, user])
    assert [(r["scope"], r["text"]) for r in left] == [("user", "is a user fact")]


async def test_two_tenants_scopes_of_the_same_ids_are_apart(
    spawn: Any,
    redis: Redis,
    caller: RpcCaller,
    scripted_model: ScriptedModel,
    events: EventRecorder,
) -> None:
    await started(spawn, redis, scripted_model)
    session, user, agent, turn = new_id(), f"u-{new_id()}", f"a-{new_id()}", f"t-{new_id()}"
    ids = {}
    for tenant in ("acme", "globex", None):
        for scope in ("session", "user", "agent"):
            remembered = await call(
                caller,
                "remember",
                {"text": f"invoices by post for {tenant}", "scope": scope},
                tenant,
                session_id=session,
                agent=agent,
                metadata={"user_id": user},
                turn_id=turn,  # the same call in each tenant: three memories
                call_id=f"call_{scope}",
            )
            ids[tenant, scope] = remembered["id"]
    assert len(set(ids.values())) == 9
    for tenant in ("acme", "globex", None):
        for scope in ("session", "user", "agent"):
            found = await call(
                caller,
                "recall",
                {"query": "invoices", "scope": scope},
                tenant,
                session_id=session,
                agent=agent,
                metadata={"user_id": user},
            )
            assert [r["text"] for r in found["results"]] == [f"invoices by post for {tenant}"]
    # globex names acme's memory: as if there were none; acme's is still there
    gone = await call(
        caller,
        "forget",
        {"id": ids["acme", "user"], "scope": "user"},
        "globex",
        metadata={"user_id": user},
    )
    assert gone == {"forgotten": False, "id": ids["acme", "user"]}
    rows = await query(
        "SELECT tenant, text FROM lw_memories WHERE scope = 'user' AND owner = $1", user
    )
    assert sorted((r["tenant"], r["text"]) for r in rows) == [
        ("acme", "invoices by post for acme"),
        ("default", "invoices by post for None"),  # tenancy off: the default tenant's rows
        ("globex", "invoices by post for globex"),
    ]
    # each tenant's memory.updated within its tenant's routing keys; tenancy off as before
    await events.wait_for(lambda evs: sum(e.agent == agent for e in evs) >= 9)
    keys = {
        e.data.memory_id: key  # type: ignore[union-attr]
        for e, key in zip(events.events, events.routing_keys, strict=True)
        if e.agent == agent
    }
    for (tenant, _), memory in ids.items():
        routing_key = f"memory.updated.{agent}.{turn}"
        assert keys[memory] == (routing_key if tenant is None else f"{tenant}.{routing_key}")


async def test_deleting_a_session_forgets_its_tenants_memories_only(
    spawn: Any,
    redis: Redis,
    scripted_model: ScriptedModel,
    topology: None,
    tmp_path: Path,
) -> None:
    await started(spawn, redis, scripted_model)
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps({"agents": [{"name": "support", "tools": ["remember"]}]}))
    session, user = new_id(), f"u-{new_id()}"  # one session id and user id, two tenants
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents,
        extra_env={
            "LOOPWIRE_MEMORY__DATABASE_URL": DATABASE_URL,
            "LOOPWIRE_TENANTS__ENABLED": "true",  # the test's user is the worker's: trusted
        },
    )
    async with (
        worker,
        LoopwireClient(WORKER_AMQP_URL, tenant="acme") as acme,
        LoopwireClient(WORKER_AMQP_URL, tenant="globex") as globex,
    ):
        for tenant, client in (("acme", acme), ("globex", globex)):
            scripted_model.expect(Reply.tool_calls(("remember", {"text": f"{tenant} session"})))
            scripted_model.expect(
                Reply.tool_calls(("remember", {"text": f"{tenant} user", "scope": "user"}))
            )
            scripted_model.expect(Reply.text("Noted."))
            result = await client.run_turn(
                "support", "remember this", session_id=session, metadata={"user_id": user}
            )
            assert result.content == "Noted."
        await globex.sessions.delete(session)
        left = await memories_of(session, user)
        await acme.sessions.delete(session)  # the test's keys and memories go as well
        after = await memories_of(session, user)
        assert worker.errors() == []
    assert left == [
        ("acme", "session", "acme session"),
        ("acme", "user", "acme user"),
        ("globex", "user", "globex user"),
    ]
    assert after == [("acme", "user", "acme user"), ("globex", "user", "globex user")]


async def memories_of(session: str, user: str) -> list[tuple[str, str, str]]:
    rows = await query(
        "SELECT tenant, scope, text FROM lw_memories WHERE owner = ANY($1)", [session, user]
    )
    return sorted((r["tenant"], r["scope"], r["text"]) for r in rows)


BEFORE_TENANTS = """
CREATE TABLE lw_memories (
    id text PRIMARY KEY,
    scope text NOT NULL,
    owner text NOT NULL,
    text text NOT NULL,
    tags text[] NOT NULL DEFAULT '{}',
    embedding real[] NOT NULL,
    created_at double precision NOT NULL
);
CREATE INDEX lw_memories_owner ON lw_memories (scope, owner);
INSERT INTO lw_memories VALUES
    ('m1', 'session', 's1', 'first', '{}', '{1, 0}', 1),
    ('m2', 'session', 's2', 'second', '{}', '{1, 0}', 2),
    ('m3', 'user', 'u1', 'a user fact', '{}', '{0, 1}', 3);
"""


@pytest.fixture
async def old_table(uid: str) -> AsyncIterator[str]:
    """The URL of a database of the test's own, with the table as it was before tenants."""
    name = f"lw_mem_upgrade_{uid}"
    admin = await asyncpg.connect(DATABASE_URL)
    try:
        await admin.execute(f"CREATE DATABASE {name}")
        url = DATABASE_URL.rsplit("/", 1)[0] + f"/{name}"
        connection = await asyncpg.connect(url)
        try:
            await connection.execute(BEFORE_TENANTS)
        finally:
            await connection.close()
        yield url
    finally:
        with contextlib.suppress(asyncpg.InvalidCatalogNameError):
            await admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
        await admin.close()


async def test_a_table_from_before_tenants_is_the_default_tenants(old_table: str) -> None:
    forgetting = SessionMemories(old_table)
    try:
        with tenancy.acting_for("acme"):
            assert await forgetting.forget("s1") == 0  # no tenant column: no acme rows
        assert await forgetting.forget("s1") == 1  # tenancy off, before the service migrated
        store = await MemoryStore.connect(old_table)
        try:
            assert [m.text for m in await store.recall("session", "s2", [1, 0], 5, "default")]
            assert await store.recall("session", "s2", [1, 0], 5, "acme") == []
            assert [m.id for m in await store.recall("user", "u1", [0, 1], 5, "default")] == ["m3"]
            indexes = await store.pool.fetch(
                "SELECT indexname FROM pg_indexes WHERE tablename = 'lw_memories'"
            )
        finally:
            await store.close()
        with tenancy.acting_for("acme"):
            assert await forgetting.forget("s2") == 0
        with tenancy.acting_for(tenancy.DEFAULT):
            assert await forgetting.forget("s2") == 1
    finally:
        await forgetting.close()
    assert sorted(r["indexname"] for r in indexes) == [
        "lw_memories_owner_tenant",
        "lw_memories_pkey",
    ]
