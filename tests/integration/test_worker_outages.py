"""A stale worker, Redis going away, the broker dropping the connection, SIGTERM, and tool
calls that cannot be delivered."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from redis.asyncio import Redis
from support_rpc import AMQP_URL, wait_until

from contracts.client import LoopwireClient, new_id
from contracts.tools import ToolCallRequest
from harness import (
    CountingToolService,
    EventRecorder,
    WorkerProcess,
    assert_valid_transcript,
    session_history,
    write_agents,
)
from tool_services.sdk import CallContext, ToolService
from tool_services.server import ToolServer
from tool_services.settings import Settings, ToolServiceSettings
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration


def tool_messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in request["messages"] if m["role"] == "tool"]


async def test_stale_worker_cannot_write_after_another_took_over(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    release = asyncio.Event()

    async def slow(request: ToolCallRequest) -> object:
        await release.wait()
        return {"results": ["slow answer"]}

    service = CountingToolService(f"slow_{uuid.uuid4().hex[:8]}", slow)
    await service.start()
    events = EventRecorder()
    await events.start()
    scripted_model.expect(Reply.tool_calls((service.name, {"q": "x"})))
    scripted_model.expect(Reply.text("answered by the new owner"))
    agents = write_agents(tmp_path / "agents.json", [service.name])
    # prefetch 1: the paused worker holds only the step it is in, so new work reaches the other
    stale = WorkerProcess(
        model_url=scripted_model.base_url, agents_file=agents, extra_env={"LOOPWIRE_PREFETCH": "1"}
    )
    fresh = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    await stale.start()
    session = new_id()
    try:
        handle = await client.start_turn("support", "go", session_id=session)
        await asyncio.wait_for(service.call_started.wait(), 20)
        assert stale.proc is not None
        stale.proc.send_signal(signal.SIGSTOP)  # paused mid-step, until past its 3 s lease
        await fresh.start()
        await client.publish(handle.request)  # the publisher retries; the new worker takes over
        # once the lease has lapsed, the new owner sends the call again (same key)
        await wait_until(lambda: len(service.received) >= 2, timeout=30)
        release.set()
        result = await handle.result(30)
        stale.proc.send_signal(signal.SIGCONT)
        # the stale worker wakes up and tries to save
        await wait_until(lambda: "STALE" in stale.log_path.read_text(), timeout=30)
        await handle.close()
    finally:
        if stale.proc is not None and stale.proc.poll() is None:
            stale.proc.send_signal(signal.SIGCONT)
        stale.close()
        fresh.close()
        await service.stop()
        await events.stop()
    assert result.content == "answered by the new owner"
    assert sum(service.executions.values()) == 1
    assert len(scripted_model.requests) == 2
    messages = await session_history(session)
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert_valid_transcript(messages)
    mine = events.for_turn(result.turn_id)
    assert [e.type for e in mine].count("tool.invoked") == 1
    assert [e.type for e in mine].count("turn.completed") == 1
    assert "STALE" in stale.stderr() or "lost the lease" in stale.stderr()


async def test_redis_outage_loses_nothing_and_resumes(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    tmp_path: Path,
    private_redis: tuple[str, Any],
) -> None:
    url, (start_redis, stop_redis) = private_redis

    async def body(request: ToolCallRequest) -> object:
        return {"results": ["ok"]}

    service = CountingToolService(f"lookup_{uuid.uuid4().hex[:8]}", body, redis_url=url)
    await service.start()
    # The first answer is lost with Redis (it could not be saved), so the model is asked again.
    scripted_model.expect(Reply.tool_calls((service.name, {"q": "a"}), delay=1.0))
    scripted_model.expect(Reply.tool_calls((service.name, {"q": "a"})))
    scripted_model.expect(Reply.text("back in business"))
    agents = write_agents(tmp_path / "agents.json", [service.name])
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents,
        redis_url=url,
        extra_env={"LOOPWIRE_REDIS_TIMEOUT_S": "1"},
    )
    await worker.start()
    session = new_id()
    try:
        handle = await client.start_turn("support", "hi", session_id=session)
        await scripted_model.wait_for_requests(1, timeout=20)
        stop_redis()
        await asyncio.sleep(2.0)
        start_redis()
        result = await handle.result(40)
        await handle.close()
    finally:
        worker.close()
        await service.stop()
    assert result.content == "back in business"
    assert sum(service.executions.values()) == 1
    messages = await session_history(session, url)
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert_valid_transcript(messages)


def close_worker_connection(pid: int) -> None:
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "pid", "client_properties"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    for line in out.splitlines():
        if f"loopwire-worker-{pid}" in line:
            conn = line.split("\t")[0]
            subprocess.run(
                ["rabbitmqctl", "-q", "close_connection", conn, "test: connection drop"],
                check=True,
                capture_output=True,
                timeout=60,
            )
            return
    raise AssertionError(f"no connection of worker {pid} in {out[:500]}")


async def test_broker_connection_drop_worker_reconnects(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    async def body(request: ToolCallRequest) -> object:
        return {"results": ["ok"]}

    service = CountingToolService(f"lookup_{uuid.uuid4().hex[:8]}", body)
    await service.start()

    def responder(request: dict[str, Any]) -> Reply:
        if tool_messages(request):
            return Reply.text("survived the drop")
        return Reply.tool_calls((service.name, {"q": "a"}), delay=2.0)

    scripted_model.respond_with(responder)
    agents = write_agents(tmp_path / "agents.json", [service.name])
    worker = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    await worker.start()
    try:
        handle = await client.start_turn("support", "hi")
        await scripted_model.wait_for_requests(1, timeout=20)
        assert worker.proc is not None
        await asyncio.to_thread(close_worker_connection, worker.proc.pid)
        result = await handle.result(60)
        await handle.close()
        # and it keeps serving new work after the reconnect
        second = await client.run_turn("support", "again", timeout=60)
    finally:
        worker.close()
        await service.stop()
    assert result.content == "survived the drop"
    assert second.content == "survived the drop"
    assert sum(service.executions.values()) == 2  # one per turn, never twice
    # the answer that arrived during the drop was saved, not asked for again: two per turn
    assert len(scripted_model.requests) == 4


async def test_sigterm_finishes_the_step_in_hand_and_exits(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    async def body(request: ToolCallRequest) -> object:
        return {"results": ["ok"]}

    service = CountingToolService(f"lookup_{uuid.uuid4().hex[:8]}", body)
    await service.start()
    scripted_model.expect(Reply.tool_calls((service.name, {"q": "a"}), delay=1.5))
    scripted_model.expect(Reply.text("finished elsewhere"))
    agents = write_agents(tmp_path / "agents.json", [service.name])
    leaving = WorkerProcess(
        model_url=scripted_model.base_url, agents_file=agents, extra_env={"LOOPWIRE_GRACE_S": "20"}
    )
    staying = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    await leaving.start()
    try:
        handle = await client.start_turn("support", "hi")
        await scripted_model.wait_for_requests(1, timeout=20)
        started = time.monotonic()
        code = await asyncio.to_thread(leaving.terminate, 30)
        elapsed = time.monotonic() - started
        await staying.start()
        result = await handle.result(30)
        await handle.close()
    finally:
        leaving.close()
        staying.close()
        await service.stop()
    assert code == 0
    assert elapsed < 20
    assert result.content == "finished elsewhere"
    assert len(scripted_model.requests) == 2  # the first step was finished, not redone
    assert sum(service.executions.values()) == 1
    assert leaving.errors() == []


async def test_sigterm_past_grace_abandons_the_step_for_another_worker(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    def responder(request: dict[str, Any]) -> Reply:
        return Reply.text("redone", delay=3.0 if len(scripted_model.requests) == 1 else 0.0)

    scripted_model.respond_with(responder)
    agents = write_agents(tmp_path / "agents.json", [])
    leaving = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents,
        extra_env={"LOOPWIRE_GRACE_S": "0.5", "LOOPWIRE_LEASE_TTL_S": "1"},
    )
    staying = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    await leaving.start()
    try:
        handle = await client.start_turn("support", "hi")
        await scripted_model.wait_for_requests(1, timeout=20)
        started = time.monotonic()
        code = await asyncio.to_thread(leaving.terminate, 30)
        elapsed = time.monotonic() - started
        await staying.start()
        result = await handle.result(30)
        await handle.close()
    finally:
        leaving.close()
        staying.close()
    assert code == 0
    assert elapsed < 3.0
    assert result.content == "redone"
    assert len(scripted_model.requests) == 2  # the abandoned model call was not saved: asked again


async def test_unbound_and_slow_tools_come_back_as_errors(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    async def never(request: ToolCallRequest) -> object:
        await asyncio.sleep(30)
        return {}

    unbound = CountingToolService(f"ghost_{uuid.uuid4().hex[:8]}", never, bind=False)
    slow = CountingToolService(f"slow_{uuid.uuid4().hex[:8]}", never, timeout_s=1)
    await unbound.start()
    await slow.start()
    scripted_model.expect(Reply.tool_calls((unbound.name, {"q": "a"}), (slow.name, {"q": "b"})))
    scripted_model.expect(Reply.text("sorry, tools failed"))
    agents = write_agents(tmp_path / "agents.json", [unbound.name, slow.name])
    worker = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    await worker.start()
    try:
        started = time.monotonic()
        result = await client.run_turn("support", "hi", timeout=30)
        elapsed = time.monotonic() - started
    finally:
        worker.close()
        await unbound.stop()
        await slow.stop()
    assert result.content == "sorry, tools failed"
    # error results are JSON objects (the empty-streak hint may follow the second one)
    decoder = json.JSONDecoder()
    results = [
        decoder.raw_decode(m["content"])[0] for m in tool_messages(scripted_model.requests[1])
    ]
    assert "tool unavailable" in results[0]["error"]
    assert "timed out" in results[1]["error"]
    assert elapsed < 10


async def test_broker_connection_drop_during_a_tool_call(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    release = asyncio.Event()

    async def slow(request: ToolCallRequest) -> object:
        await release.wait()
        return {"results": ["after the drop"]}

    service = CountingToolService(f"slow_{uuid.uuid4().hex[:8]}", slow)
    await service.start()
    scripted_model.expect(Reply.tool_calls((service.name, {"q": "a"})))
    scripted_model.expect(
        Reply.text("got it"),
        check=lambda body: "after the drop" in str(tool_messages(body)),
    )
    agents = write_agents(tmp_path / "agents.json", [service.name])
    worker = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    await worker.start()
    try:
        handle = await client.start_turn("support", "hi")
        await asyncio.wait_for(service.call_started.wait(), 20)
        assert worker.proc is not None
        await asyncio.to_thread(close_worker_connection, worker.proc.pid)
        release.set()  # the reply goes to a reply queue that no longer exists
        result = await handle.result(60)
        await handle.close()
    finally:
        worker.close()
        await service.stop()
    assert result.content == "got it"
    assert sum(service.executions.values()) == 1  # re-sent with its key, answered from the store
    assert len(scripted_model.requests) == 2


async def test_a_redis_pause_while_a_tool_runs_does_not_make_the_live_tool_look_dead(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    tmp_path: Path,
    private_redis: tuple[str, Any],
) -> None:
    """Redis away for 8 s while the tool service runs the call: the model gets the tool's real
    result, is offered the tool again afterwards, and the tool ran once."""
    url, _ = private_redis
    paused = Redis.from_url(url)
    name = f"pauser_{uuid.uuid4().hex[:8]}"
    service = ToolService(name)
    runs: list[str] = []

    class Args(BaseModel):
        q: str

    async def pause_redis(args: Args, ctx: CallContext) -> dict[str, object]:
        runs.append(ctx.turn_id)
        await paused.execute_command("CLIENT", "PAUSE", "8000", "ALL")
        return {"results": [f"found {args.q}"]}

    service.add_tool(
        pause_redis,
        name=name,
        description="looks up",
        timeout_s=30,
        idempotent=False,
        args_model=Args,
    )
    server = ToolServer(
        service, Settings(amqp_url=AMQP_URL, redis_url=url, tools=ToolServiceSettings())
    )
    await server.start()
    scripted_model.expect(Reply.tool_calls((name, {"q": "order 7"})))
    scripted_model.expect(Reply.tool_calls((name, {"q": "order 8"})))
    scripted_model.expect(Reply.text("both found"))
    agents = write_agents(tmp_path / "agents.json", [name])
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents,
        redis_url=url,
        extra_env={"LOOPWIRE_REDIS_TIMEOUT_S": "1"},
    )
    await worker.start()
    try:
        handle = await client.start_turn("support", "find orders 7 and 8", session_id=new_id())
        result = await handle.result(90)
        await handle.close()
    finally:
        worker.close()
        await server.stop()
        await paused.aclose()
    assert result.content == "both found"
    second, third = scripted_model.requests[1], scripted_model.requests[2]
    for request in (second, third):
        assert [t["function"]["name"] for t in request.get("tools", [])] == [name], (
            "the live tool is still offered"
        )
    results = [json.loads(m["content"]) for m in tool_messages(third)]
    assert results == [{"results": ["found order 7"]}, {"results": ["found order 8"]}]
    assert len(runs) == 2, "each call ran once"
