"""The distributed worker end to end: real RabbitMQ and Redis, worker subprocesses,
the scripted model over HTTP, a counting tool service."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import aio_pika
import pytest
from redis.asyncio import Redis
from support_rpc import wait_until

from contracts import keys
from contracts import topology as t
from contracts.client import LoopwireClient, new_id
from contracts.codec import encode, encode_obj, read_stored
from contracts.state import AgentState
from contracts.tools import ToolCallReply, ToolCallRequest
from contracts.turns import InputMessage, TurnRequest
from contracts.work import StepWork
from harness import (
    CountingToolService,
    EventRecorder,
    WorkerProcess,
    write_agents,
)
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration


def start_worker(
    tmp_path: Path, model: ScriptedModel, tools: list[str], name: str = "w"
) -> WorkerProcess:
    agents = write_agents(tmp_path / f"agents-{name}.json", tools)
    return WorkerProcess(model_url=model.base_url, agents_file=agents)


async def test_turn_with_tool_steps_end_to_end(
    topology: None,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refunds"})))
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "invoices"})))
    scripted_model.expect(Reply.text("Refunds take 5 days.", delay=0.3))
    async with start_worker(tmp_path, scripted_model, [lookup.name]) as worker:
        result = await client.run_turn("support", "How long do refunds take?", timeout=30)
    assert worker.errors() == []
    assert result.finish_reason == "stop"
    assert result.content == "Refunds take 5 days."
    assert result.steps == 3
    assert sum(lookup.executions.values()) == 2
    await events.wait_for(lambda evs: any(e.type == "turn.completed" for e in evs))
    types = [e.type for e in events.for_turn(result.turn_id)]
    assert types == [
        "turn.accepted",
        "turn.started",
        "tool.invoking",
        "tool.invoked",
        "step.completed",
        "tool.invoking",
        "tool.invoked",
        "step.completed",
        "step.completed",
        "turn.completed",
    ]
    invoked = [e for e in events.for_turn(result.turn_id) if e.type == "tool.invoked"]
    assert all(e.data.outcome == "ok" and e.data.duration_s > 0 for e in invoked)  # type: ignore[union-attr]
    steps = [e.data for e in events.for_turn(result.turn_id) if e.type == "step.completed"]
    # the last model call was held 0.3 s: the step's timings say so, and a step lasts at least
    # its model call
    assert steps[-1].model_duration_s >= 0.3  # type: ignore[union-attr]
    assert all(s.duration_s >= s.model_duration_s > 0 for s in steps)  # type: ignore[union-attr]
    # the second model call saw the first tool's result with its call id
    second = scripted_model.requests[1]["messages"]
    tool_messages = [m for m in second if m["role"] == "tool"]
    assert tool_messages and "found refunds" in tool_messages[0]["content"]


async def test_duplicate_turn_request_runs_once(
    topology: None,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.text("only once"))
    async with start_worker(tmp_path, scripted_model, [lookup.name]):
        handle = await client.start_turn("support", "hello")
        first = await handle.result(30)
        await client.publish(handle.request)  # the same request, same turn id, same reply_to
        again = await asyncio.wait_for(_next_result(handle), 15)
        await handle.close()
    assert first.content == again.content == "only once"
    assert again.turn_id == first.turn_id
    assert len(scripted_model.requests) == 1


async def _next_result(handle: object) -> object:
    from contracts.turns import TurnResult

    queue = handle._events  # type: ignore[attr-defined]
    while True:
        item = await queue.get()
        if isinstance(item, TurnResult):
            return item


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"\xc1garbage", "malformed"),
        (encode_obj({"turn_id": "t1"}), "schema"),
        (
            encode_obj(
                {
                    "schema_version": 1,
                    "turn_id": "a.b*c",
                    "session_id": "s",
                    "agent": "support",
                    "input": [{"role": "user", "content": "x"}],
                }
            ),
            "schema",
        ),
        (b"\x91" * 50 + b"\x01", "malformed"),
        (encode_obj({"turn_id": "big", "pad": "x" * (4 * 1024 * 1024)}), "oversize"),
        (encode_obj({"turn_id": "t1", "session_id": "s\n1", "agent": "support"}), "schema"),
        (encode_obj({"turn_id": "t" * 10_000}), "schema"),
    ],
    ids=["garbage", "missing-fields", "hostile-id", "deep", "oversize", "newline-id", "10k-id"],
)
async def test_bad_input_is_dead_lettered_with_a_reason(
    topology: None,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    tmp_path: Path,
    body: bytes,
    code: str,
) -> None:
    scripted_model.expect(Reply.text("still serving"))
    async with start_worker(tmp_path, scripted_model, [lookup.name]):
        await client.channel.default_exchange.publish(
            aio_pika.Message(body, headers={t.H_KIND: t.KIND_START}), routing_key=t.TURNS_QUEUE
        )
        dead = await client.channel.get_queue(t.DEAD_LETTER_QUEUE, ensure=False)
        message = None
        for _ in range(100):
            message = await dead.get(no_ack=True, fail=False)
            if message is not None:
                break
            await asyncio.sleep(0.1)
        assert message is not None, "nothing was dead-lettered"
        assert message.body == body
        headers = message.headers or {}
        assert headers[t.H_REASON_CODE] == code
        assert str(headers[t.H_REASON])
        result = await client.run_turn("support", "are you alive?", timeout=20)
        assert result.content == "still serving"


async def test_unknown_agent_is_rejected_with_event(
    topology: None,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    async with start_worker(tmp_path, scripted_model, [lookup.name]):
        turn_id = new_id()
        await client.publish(
            TurnRequest(
                turn_id=turn_id,
                session_id="s1",
                agent="nobody",
                input=(InputMessage(content="hi"),),
            )
        )
        await events.wait_for(
            lambda evs: any(e.type == "turn.rejected" and e.turn_id == turn_id for e in evs)
        )
    rejected = next(e for e in events.events if e.turn_id == turn_id)
    assert rejected.data.code == "unknown_agent"  # type: ignore[union-attr]
    assert "nobody" in rejected.data.reason  # type: ignore[union-attr]


async def test_worker_killed_during_tool_call_resumes_on_another(
    topology: None,
    scripted_model: ScriptedModel,
    events: EventRecorder,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    release = asyncio.Event()

    async def slow(request: ToolCallRequest) -> object:
        await release.wait()
        return {"results": ["slow answer"]}

    service = CountingToolService(f"slow_{uuid.uuid4().hex[:8]}", slow)
    await service.start()
    scripted_model.expect(Reply.tool_calls((service.name, {"q": "x"})))
    scripted_model.expect(Reply.text("done after crash"))
    first = start_worker(tmp_path, scripted_model, [service.name], "a")
    second = start_worker(tmp_path, scripted_model, [service.name], "b")
    await first.start()
    try:
        handle = await client.start_turn("support", "go")
        await asyncio.wait_for(service.call_started.wait(), 20)
        first.kill()  # the model's answer was saved; the tool call is in flight
        await second.start()
        release.set()  # the call ends and its reply is stored, for a dead reply queue
        await wait_until(lambda: bool(service.replies), timeout=30)
        result = await handle.result(30)
        await handle.close()
    finally:
        first.close()
        second.close()
        await service.stop()
    assert first.errors() == []
    assert second.errors() == []
    assert result.content == "done after crash"
    assert (
        sum(service.executions.values()) == 1
    )  # re-sent with the same key, answered from the store
    assert len(scripted_model.requests) == 2  # the saved model answer was not asked for again


async def test_wrong_schema_with_readable_turn_id_is_announced(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    worker = start_worker(tmp_path, scripted_model, [lookup.name])
    await worker.start()
    turn_id = new_id()
    try:
        body = encode_obj(
            {"schema_version": 1, "turn_id": turn_id, "session_id": "s1", "agent": "support"}
        )
        await client.channel.default_exchange.publish(
            aio_pika.Message(body), routing_key=t.TURNS_QUEUE
        )
        await events.wait_for(lambda evs: any(e.turn_id == turn_id for e in evs))
    finally:
        worker.close()
    rejected = next(e for e in events.events if e.turn_id == turn_id)
    assert rejected.type == "turn.rejected"
    assert rejected.data.code == "schema"  # type: ignore[union-attr]
    assert "input" in rejected.data.reason  # type: ignore[union-attr]
    assert worker.errors() == []


async def test_events_carry_cloudevents_headers_and_routing_keys(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "a"})))
    scripted_model.expect(Reply.text("done"))
    async with start_worker(tmp_path, scripted_model, [lookup.name]):
        result = await client.run_turn("support", "hi", timeout=30)
        await events.wait_for(
            lambda evs: any(e.type == "turn.completed" and e.turn_id == result.turn_id for e in evs)
        )
    mine = [i for i, e in enumerate(events.events) if e.turn_id == result.turn_id]
    assert mine
    for i in mine:
        event, headers, key = events.events[i], events.headers[i], events.routing_keys[i]
        assert key == f"{event.type}.support.{result.turn_id}"
        assert headers["ce-specversion"] == "1.0"
        assert headers["ce-id"] == event.id
        assert headers["ce-type"] == event.type
        assert headers["ce-source"] == "/loopwire/worker"
        assert str(headers["ce-time"]).endswith("Z")
    ids = [events.events[i].id for i in mine]
    assert len(ids) == len(set(ids)), "event ids are unique within a turn"


async def test_redelivered_last_step_repeats_the_reply_and_event(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.text("the answer"))
    async with start_worker(tmp_path, scripted_model, [lookup.name]):
        handle = await client.start_turn("support", "hi")
        first = await handle.result(30)
        # the last step's message again, taken before, as after a failure between the final
        # save and the ack (a copy that was never taken would repeat nothing)
        last = StepWork(session_id=first.session_id, turn_id=first.turn_id, step=first.steps - 1)
        await client.channel.default_exchange.publish(
            aio_pika.Message(encode(last), headers={t.H_KIND: t.KIND_STEP, t.H_REDONE: True}),
            routing_key=t.TURNS_QUEUE,
        )
        again = await asyncio.wait_for(_next_result(handle), 15)
        await handle.close()
        await events.wait_for(
            lambda evs: (
                sum(e.type == "turn.completed" and e.turn_id == first.turn_id for e in evs) == 2
            )
        )
    assert again == first  # the stored result, not a second run
    completed = [
        e for e in events.events if e.type == "turn.completed" and e.turn_id == first.turn_id
    ]
    assert completed[0].id == completed[1].id  # the same event id: subscribers drop the duplicate
    assert len(scripted_model.requests) == 1


async def test_state_updates_reach_the_session_and_a_persist_false_turn_leaves_it_as_it_was(
    scripted_model: ScriptedModel, client: LoopwireClient, redis: Redis, tmp_path: Path
) -> None:
    async def body(request: ToolCallRequest) -> object:
        tier = str(request.arguments.get("q"))
        return ToolCallReply(call_id="x", status="ok", value="noted", state_updates={"tier": tier})

    service = CountingToolService(f"tier_{uuid.uuid4().hex[:8]}", body)
    await service.start()
    for tier in ("gold", "silver"):
        scripted_model.expect(Reply.tool_calls((service.name, {"q": tier})))
        scripted_model.expect(Reply.text(f"you are {tier}"))
    session = f"s-{uuid.uuid4().hex[:10]}"
    try:
        async with start_worker(tmp_path, scripted_model, [service.name]) as worker:
            kept = await client.run_turn("support", "set gold", session_id=session, timeout=30)
            before = await stored_state(redis, session)
            transient = await client.run_turn(
                "support", "try silver", session_id=session, persist=False, timeout=30
            )
            after = await stored_state(redis, session)
    finally:
        await service.stop()
        for key in [k async for k in redis.scan_iter(match=f"lw:{{{session}}}:*")]:
            await redis.delete(key)
    assert worker.errors() == []
    assert (kept.content, transient.content) == ("you are gold", "you are silver")
    assert before.context.kv == {"tier": "gold"}, "a persisted turn's tool updates the session"
    assert after.context.kv == {"tier": "gold"}, "a persist: false turn's do not"
    assert after.execution_count == before.execution_count == 1
    assert after.history_len == before.history_len == 4


async def stored_state(redis: Redis, session: str) -> AgentState:
    blob = await redis.hget(keys.session_state(session), "s")
    assert blob is not None
    return read_stored(blob, AgentState)


async def test_a_session_can_switch_agents_between_turns(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    lookup: CountingToolService,
    tmp_path: Path,
) -> None:
    """The second turn runs as its own agent: its tools and limits, the session's history."""
    agents = tmp_path / "agents.json"
    agents.write_text(
        json.dumps(
            {
                "agents": [
                    {"name": "support", "tools": [lookup.name]},
                    {"name": "billing", "tools": [], "limits": {"max_tool_iterations": 1}},
                ]
            }
        )
    )
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "order"})))
    scripted_model.expect(Reply.text("it shipped"))
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "invoice"})))
    session = new_id()
    worker = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    await worker.start()
    try:
        first = await client.run_turn("support", "where is it?", session_id=session, timeout=30)
        second = await client.run_turn("billing", "and the bill?", session_id=session, timeout=30)
    finally:
        worker.close()
    assert worker.errors() == []
    assert (first.agent, first.content) == ("support", "it shipped")
    billing = scripted_model.requests[2]
    assert "tools" not in billing or billing["tools"] == [], "billing offers no tools"
    assert [m["content"] for m in billing["messages"] if m["role"] == "user"] == [
        "where is it?",
        "and the bill?",
    ]
    assert (second.agent, second.finish_reason) == ("billing", "max_iterations")
    assert sum(lookup.executions.values()) == 1, "billing's call to a tool it lacks did not run"


async def test_structured_output_is_asked_for_validated_and_repaired(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    schema = {
        "type": "object",
        "properties": {"label": {"enum": ["billing", "tech"]}},
        "required": ["label"],
    }
    agents = tmp_path / "agents.json"
    agents.write_text(
        json.dumps({"agents": [{"name": "triage", "tools": [], "output_schema": schema}]})
    )
    scripted_model.expect(Reply.text('{"label": "sales"}'))
    scripted_model.expect(Reply.text('{"label": "billing"}'))
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker:
        result = await client.run_turn("triage", "charged twice", timeout=30)
    assert worker.errors() == []
    assert (result.finish_reason, result.output, result.steps) == ("stop", {"label": "billing"}, 2)
    first = scripted_model.requests[0]
    assert first["response_format"]["type"] == "json_schema"
    assert first["response_format"]["json_schema"]["schema"] == schema
    repair = scripted_model.requests[1]["messages"][-1]
    assert repair["role"] == "user" and "'sales' is not one of" in repair["content"]
