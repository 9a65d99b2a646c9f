"""Sessions as a resource over the real broker and Redis: read a session's summary, history,
turns and a result through the client and the CLI, and a turn's step records page by page
until they expire; delete a session with turns still queued and running, and find nothing of
it left in Redis; bad queries are dead-lettered."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aio_pika
import pytest
from redis.asyncio import Redis
from support_rpc import AMQP_URL

from contracts import keys
from contracts import topology as t
from contracts.client import LoopwireClient, new_id
from contracts.codec import decode, encode, encode_obj
from contracts.registry import live_tools
from contracts.session_client import SessionError
from contracts.sessions import SessionQuery, SessionReply
from contracts.state import AgentStep, StepExecution
from contracts.turns import TurnResult
from harness import CountingToolService, EventRecorder, WorkerProcess
from worker.session.records import SessionRecords
from worker.testing.scripted_model import Reply, ScriptedModel
from worker.transport.session_reads import answer

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def agents_file(tmp_path: Path, tools: list[str]) -> Path:
    path = tmp_path / "agents.json"
    agent = {
        "name": "support",
        "tools": tools,
        "hooks": ["redact"],
        "limits": {"empty_streak_after": 0},
    }
    path.write_text(json.dumps({"agents": [agent]}))
    return path


async def leftovers(redis: Redis, session: str, turn_ids: list[str]) -> list[str]:
    """Every key of the session, or of its turns, still in Redis (but its fence, a bare counter
    that stays with an expiry so that fencing tokens never go back)."""
    fence = keys.session_fence(session)
    assert not await redis.exists(fence) or await redis.ttl(fence) > 0
    found = [k.decode() async for k in redis.scan_iter(match=f"*{{{session}}}*")]
    found = [k for k in found if k != fence]
    for turn_id in turn_ids:
        found += [k.decode() async for k in redis.scan_iter(match=f"*{turn_id}*")]
    waiting = await redis.hkeys(keys.approvals_waiting())
    found += [f.decode() for f in waiting if any(f.decode().startswith(t) for t in turn_ids)]
    return found


async def test_a_session_is_read_and_then_deleted_leaving_nothing(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    lookup: CountingToolService,
    events: EventRecorder,
    redis: Redis,
    spawn: object,
    tmp_path: Path,
) -> None:
    notes = await spawn("tool_services.notes", tool="file_note", env={})  # type: ignore[operator]
    for _ in range(200):
        if "file_note" in await live_tools(redis):
            break
        await asyncio.sleep(0.05)
    session = new_id()
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "order 7"})))
    scripted_model.expect(Reply.tool_calls(("file_note", {"text": "customer wrote"})))
    scripted_model.expect(Reply.text("Order 7 shipped."))
    scripted_model.expect(Reply.text("You are welcome."))
    agents = agents_file(tmp_path, [lookup.name, "file_note"])
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as w:
        first = await client.run_turn(
            "support", "where is order 7? mail ann@example.com", session_id=session, timeout=30
        )
        second = await client.run_turn("support", "thanks", session_id=session, timeout=30)

        summary = await client.sessions.get(session)
        assert summary is not None
        assert (summary.agent, summary.turns, summary.running) == ("support", 2, None)
        assert summary.spent.total_tokens == first.usage.total_tokens + second.usage.total_tokens
        everything, total = await client.sessions.history(session, limit=100)
        assert total == len(everything) == 8
        assert [m.role for m in everything[:3]] == ["user", "assistant", "tool"]
        newest, _ = await client.sessions.history(session, limit=2, newest_first=True)
        assert [m.content for m in newest] == ["You are welcome.", "thanks"]
        page, _ = await client.sessions.history(session, offset=2, limit=2)
        assert page == everything[2:4]
        turns = await client.sessions.turns(session)
        assert {(x.turn_id, x.status, x.finish_reason) for x in turns} == {
            (first.turn_id, "done", "stop"),
            (second.turn_id, "done", "stop"),
        }
        assert await client.sessions.result(first.turn_id) == first
        assert await client.sessions.get(new_id()) is None
        assert await redis.exists(keys.redaction_map(session)) and await redis.exists(
            keys.session_notes(session)
        )

        # a turn running (its model slow) and one queued behind it
        scripted_model.expect(Reply.text("never seen", delay=30))
        running = await client.start_turn("support", "one more", session_id=session)
        await running.accepted(20)
        queued = await client.start_turn("support", "and another", session_id=session)
        await queued.accepted(20)
        await scripted_model.wait_for_requests(5, timeout=20)
        deleted = await client.sessions.delete(session, reason="erasure request", by="test")
        ended = [await running.result(20), await queued.result(20)]
        await running.close()
        await queued.close()
        await events.wait_for(lambda evs: any(e.type == "session.deleted" for e in evs))
        assert await client.sessions.get(session) is None
        assert await client.sessions.result(first.turn_id) is None
    assert w.errors() == []
    assert notes.process.returncode is None  # type: ignore[attr-defined]
    assert deleted > 0
    assert [(r.finish_reason, r.stopped_by) for r in ended] == [
        ("cancelled", "erasure request")
    ] * 2
    turn_ids = [first.turn_id, second.turn_id, running.turn_id, queued.turn_id]
    assert await leftovers(redis, session, turn_ids) == []
    gone = next(e for e in events.events if e.type == "session.deleted")
    assert gone.session_id == session and gone.data.deleted_keys == deleted  # type: ignore[union-attr]
    assert "ann@example.com" not in json.dumps([e.model_dump(mode="json") for e in events.events])


async def test_a_turns_step_records_are_read_page_by_page_until_they_expire(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    lookup: CountingToolService,
    redis: Redis,
    uid: str,
    tmp_path: Path,
) -> None:
    session, turn = f"s-{uid}", f"t-{uid}-1"
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "order 7"})))
    scripted_model.expect(Reply.text("Order 7 shipped."))
    agents = agents_file(tmp_path, [lookup.name])
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as w:
        result = await client.run_turn(
            "support", "where is order 7?", session_id=session, turn_id=turn, timeout=30
        )
        records = await client.sessions.steps(turn)  # its session found from the turn
        second = await client.sessions.steps(turn, session, offset=1, limit=1)
        beyond = await client.sessions.steps(turn, offset=2)
        with pytest.raises(SessionError) as unknown:
            await client.sessions.steps(f"t-{uid}-never")
        # the records expire with the result, ttl_s past the turn's end: as if that was now
        await redis.delete(keys.turn_steps(session, turn), keys.turn_result(session, turn))
        with pytest.raises(SessionError) as expired:
            await client.sessions.steps(turn)
    assert w.errors() == []
    assert [r.step.index for r in records] == [0, 1] and second == records[1:]
    assert beyond == []
    call = records[0].step.tool_executions[0]
    assert (call.name, call.arguments, call.outcome) == (lookup.name, {"q": "order 7"}, "ok")
    assert call.content == "" and call.completed_at >= call.started_at  # the text: in history
    answers = [r.step.response for r in records]
    assert answers[1] is not None and answers[1].message.content == "Order 7 shipped."
    used = sum(a.usage.total_tokens for a in answers if a is not None)
    assert used == result.usage.total_tokens > 0
    assert all(r.completed_at >= r.started_at and r.step.output_messages == () for r in records)
    assert (unknown.value.code, str(unknown.value)) == ("not_found", f"no turn t-{uid}-never")
    assert expired.value.code == "not_found" and "expired" in str(expired.value)


async def test_a_steps_read_counts_the_records_and_tells_a_turn_without_steps_apart(
    redis: Redis, uid: str
) -> None:
    """``total`` counts every record, whatever the page; a turn that ended before its first
    step (cancelled while queued) has none and reads as such, not as expired."""
    session, turn, queued = f"s-{uid}", f"t-{uid}-1", f"t-{uid}-2"
    for index in range(3):
        record = StepExecution(
            step=AgentStep(index=index, input_count=2), started_at=1.0, completed_at=2.0
        )
        await redis.rpush(keys.turn_steps(session, turn), encode(record.stored()))
    await redis.hset(keys.session_turns(session), mapping={turn: "done", queued: "done"})
    cancelled = TurnResult(
        turn_id=queued,
        session_id=session,
        agent="support",
        content=None,
        finish_reason="cancelled",
        stopped_by="user",
        steps=0,
        duration_s=0.0,
        completed_at=2.0,
    )
    await redis.set(keys.turn_result(session, queued), encode(cancelled))
    records = SessionRecords(redis)

    def query(turn_id: str, **paging: int) -> SessionQuery:
        return SessionQuery(op="steps", session_id=session, turn_id=turn_id, **paging)

    page = await answer(records, query(turn, offset=1, limit=1))
    none = await answer(records, query(queued))
    assert (page.ok, page.total, [r.step.index for r in page.steps]) == (True, 3, [1])
    assert (none.ok, none.total, none.steps) == (True, 0, ())


async def test_the_cli_shows_a_session_and_a_result_and_deletes_it(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    scripted_model.expect(Reply.text("hello there"))
    session = new_id()
    env = {**os.environ, "LOOPWIRE_AMQP_URL": AMQP_URL}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "worker.cli", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    async with WorkerProcess(
        model_url=scripted_model.base_url, agents_file=agents_file(tmp_path, [])
    ):
        result = await client.run_turn("support", "hi", session_id=session, timeout=20)
        shown = await asyncio.to_thread(cli, "session", "show", session)
        history = await asyncio.to_thread(cli, "session", "history", session)
        fetched = await asyncio.to_thread(cli, "result", result.turn_id, "--json")
        refused = await asyncio.to_thread(cli, "session", "delete", session)
        deleted = await asyncio.to_thread(cli, "session", "delete", session, "--yes")
        missing = await asyncio.to_thread(cli, "session", "show", session)
    assert shown.returncode == 0, shown.stderr
    assert f"session {session} (agent support): 1 turn(s) done, 2 message(s)" in shown.stdout
    assert f"{result.turn_id}  done  stop" in shown.stdout
    assert history.returncode == 0 and "assistant hello there" in history.stdout.replace("  ", " ")
    assert json.loads(fetched.stdout)["result"]["content"] == "hello there"
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert deleted.returncode == 0 and f"session {session} deleted" in deleted.stdout
    assert missing.returncode == 5 and "no session" in missing.stderr


async def test_a_bad_query_is_dead_lettered_and_answered(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    async with WorkerProcess(
        model_url=scripted_model.base_url, agents_file=agents_file(tmp_path, [])
    ):
        connection = await aio_pika.connect(AMQP_URL)
        try:
            channel = await connection.channel()
            replies = await channel.declare_queue(exclusive=True, auto_delete=True)
            await channel.default_exchange.publish(
                aio_pika.Message(
                    encode_obj({"op": "history"}), reply_to=replies.name, correlation_id="q1"
                ),
                routing_key=t.SESSIONS_QUEUE,
            )
            message = await _next(replies)
            dead = await channel.get_queue(t.DEAD_LETTER_QUEUE)
            letter = await _next(dead)
        finally:
            await connection.close()
    reply = decode(message.body, SessionReply)
    assert (reply.ok, reply.code, message.correlation_id) == (False, "bad_request", "q1")
    assert "session_id" in (reply.error or "")
    assert (letter.headers or {})[t.H_REASON_CODE] == "schema"


async def _next(queue: aio_pika.abc.AbstractQueue) -> aio_pika.abc.AbstractIncomingMessage:
    for _ in range(200):
        message = await queue.get(no_ack=True, fail=False)
        if message is not None:
            return message
        await asyncio.sleep(0.05)
    raise AssertionError(f"nothing arrived on {queue.name}")
