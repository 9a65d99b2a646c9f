"""The memory tool service over the real store (PostgreSQL), the broker and the scripted
model's embeddings: recall finds what was remembered and not another scope's, two instances
share their memories, a killed instance loses nothing, a redone call remembers once, deleting
a session forgets its memories, and every change is announced without its text."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from redis.asyncio import Redis
from support_rpc import RpcCaller, announcements

from contracts.client import LoopwireClient, new_id
from harness import EventRecorder, WorkerProcess
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


async def call(caller: RpcCaller, tool: str, arguments: dict[str, Any], **context: Any) -> Any:
    context.setdefault("turn_id", f"t-{uuid.uuid4().hex[:8]}")
    reply = await caller.call(caller.request(tool, arguments, **context), timeout=20)
    assert reply.status == "ok", reply.error
    return reply.value


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
    connection = await asyncpg.connect(DATABASE_URL)
    try:
        count = await connection.fetchval(
            "SELECT count(*) FROM lw_memories WHERE scope = 'session' AND owner = $1", session
        )
    finally:
        await connection.close()
    assert count == 1


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
    connection = await asyncpg.connect(DATABASE_URL)
    try:
        left = await connection.fetch(
            "SELECT scope, text FROM lw_memories WHERE owner = ANY($1)", [session, user]
        )
    finally:
        await connection.close()
    assert [(r["scope"], r["text"]) for r in left] == [("user", "is a user fact")]
