"""The publisher client, the ``loopwire`` command line and the demo, against a live worker."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from support_rpc import wait_until
from yarl import URL

from contracts import topology as t
from contracts.client import LoopwireClient, TurnRejectedError, new_id
from contracts.codec import encode
from contracts.events import Event
from contracts.turns import InputMessage, TurnParent, TurnRequest
from harness import (
    AMQP_URL,
    REDIS_URL,
    ROOT,
    CountingToolService,
    WorkerProcess,
    event_bindings,
    run_cli,
    subscribed,
    write_agents,
)
from worker.loop.children import child_turn_id
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration
LOOPWIRE = [sys.executable, "-m", "worker.cli"]


def tool_then_answer(tool: str) -> Any:
    def responder(request: dict[str, Any]) -> Reply:
        messages = request["messages"]
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        if any(m["role"] == "tool" for m in messages[last_user:]):
            return Reply.text("the answer")
        return Reply.tool_calls((tool, {"q": "x"}))

    return responder


@pytest.fixture
async def live(
    client: LoopwireClient,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    tmp_path: Path,
) -> AsyncIterator[WorkerProcess]:
    scripted_model.respond_with(tool_then_answer(lookup.name))
    agents = write_agents(tmp_path / "agents.json", [lookup.name])
    worker = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    await worker.start()
    yield worker
    worker.close()
    assert worker.errors() == []


async def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LOOPWIRE_AMQP_URL": AMQP_URL, "LOOPWIRE_REDIS_URL": REDIS_URL}
    return await run_cli(*args, env=env, timeout=timeout)


async def test_run_turn_returns_the_result(live: WorkerProcess, client: LoopwireClient) -> None:
    session = f"cli-{new_id()}"
    result = await client.run_turn("support", "hello", session_id=session, timeout=30)
    assert result.content == "the answer"
    assert result.session_id == session
    assert result.steps == 2


async def test_start_turn_streams_events_then_result(
    live: WorkerProcess, client: LoopwireClient
) -> None:
    handle = await client.start_turn("support", "hello")
    seen = [event async for event in handle.events()]
    result = await handle.result(10)
    await handle.close()
    assert [e.type for e in seen][:2] == ["turn.accepted", "turn.started"]
    assert seen[-1].type == "turn.completed"
    assert {e.turn_id for e in seen} == {handle.turn_id}
    assert result.content == "the answer"


async def test_subscribe_receives_only_matching_events(
    live: WorkerProcess, client: LoopwireClient
) -> None:
    received: list[Event] = []

    async def collect() -> None:
        async for event in client.subscribe("tool.invoked.#"):
            received.append(event)
            return

    bound = await asyncio.to_thread(event_bindings, "tool.invoked.#")
    task = asyncio.create_task(collect())
    await subscribed("tool.invoked.#", bound)  # before the turn starts
    await client.run_turn("support", "hello", timeout=30)
    await asyncio.wait_for(task, 10)
    assert [e.type for e in received] == ["tool.invoked"]
    assert received[0].data.outcome == "ok"  # type: ignore[union-attr]


async def test_rejected_turn_raises_with_the_reason(
    live: WorkerProcess, client: LoopwireClient
) -> None:
    with pytest.raises(TurnRejectedError, match="unknown agent"):
        await client.run_turn("nobody", "hello", timeout=30)


async def test_cli_turn_prints_the_answer_and_json(live: WorkerProcess) -> None:
    plain = await cli("turn", "hello", "--agent", "support")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == "the answer"
    as_json = await cli("turn", "hello", "--agent", "support", "--follow", "--json")
    assert as_json.returncode == 0, as_json.stderr
    lines = [json.loads(line) for line in as_json.stdout.splitlines()]
    types = [line.get("type") for line in lines[:-1]]
    assert types[0] == "turn.accepted"
    assert "tool.invoked" in types
    assert types[-1] == "turn.completed"
    assert lines[-1]["result"]["content"] == "the answer"


async def test_cli_follow_prints_events_as_text(live: WorkerProcess) -> None:
    out = await cli("turn", "hello", "--agent", "support", "--follow")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("turn.accepted")
    assert any(line.startswith("tool.invoked") and " ok in " in line for line in lines)
    assert lines[-1] == "the answer"


async def test_cli_turn_exit_codes(live: WorkerProcess) -> None:
    capped = await cli("turn", "hello", "--agent", "support", "--max-iterations", "1")
    assert capped.returncode == 4
    assert "iteration cap" in capped.stderr
    rejected = await cli("turn", "hello", "--agent", "nobody")
    assert rejected.returncode == 3
    assert rejected.stderr.startswith("error: turn rejected:")
    assert len(rejected.stderr.strip().splitlines()) == 1


async def test_cli_unreachable_broker_is_one_line() -> None:
    out = await cli("--amqp-url", "amqp://guest:guest@127.0.0.1:1/", "turn", "hello")
    assert out.returncode == 1
    assert out.stderr.startswith("error: cannot reach RabbitMQ at 127.0.0.1:1/ (")
    assert "guest" not in out.stderr  # neither the user nor the password
    assert len(out.stderr.strip().splitlines()) == 1


async def test_cli_tail_prints_matching_events(live: WorkerProcess, client: LoopwireClient) -> None:
    env = {**os.environ, "LOOPWIRE_AMQP_URL": AMQP_URL, "LOOPWIRE_REDIS_URL": REDIS_URL}
    bound = await asyncio.to_thread(event_bindings, "turn.completed.#")
    tail = await asyncio.create_subprocess_exec(
        *LOOPWIRE,
        "tail",
        "turn.completed.#",
        "--count",
        "1",
        "--json",
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    await subscribed("turn.completed.#", bound)
    result = await client.run_turn("support", "hello", timeout=30)
    stdout, stderr = await asyncio.wait_for(tail.communicate(), 20)
    assert tail.returncode == 0, stderr
    event = json.loads(stdout.decode().strip())
    assert event["type"] == "turn.completed"
    assert event["turn_id"] == result.turn_id


async def test_cli_dlq_list_and_replay(
    client: LoopwireClient,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    tmp_path: Path,
) -> None:
    scripted_model.respond_with(tool_then_answer(lookup.name))
    first = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=write_agents(tmp_path / "a.json", [lookup.name]),
    )
    await first.start()
    handle = await client.start_turn("late", "hello")
    try:
        with pytest.raises(TurnRejectedError):  # announced once it was dead-lettered
            await handle.result(30)
        listed = await cli("dlq", "list")
        assert listed.returncode == 0, listed.stderr
        row = next(line for line in listed.stdout.splitlines() if handle.turn_id in line)
        assert "unknown_agent" in row
        assert "'late'" in row
        dead_id = row.split()[0]
        first.close()
        # the agent now exists: replaying the dead letter runs the turn
        agents = tmp_path / "b.json"
        agents.write_text(json.dumps({"agents": [{"name": "late", "tools": [lookup.name]}]}))
        second = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
        await second.start()
        completed: list[Event] = []

        async def watch() -> None:
            async for event in client.subscribe(pattern):
                completed.append(event)
                return

        pattern = f"turn.completed.*.{handle.turn_id}"
        watcher = asyncio.create_task(watch())
        await subscribed(pattern, 0)
        try:
            replayed = await cli("dlq", "replay", dead_id)
            assert replayed.returncode == 0, replayed.stderr
            await asyncio.wait_for(watcher, 30)
        finally:
            second.close()
        assert completed[0].data.result.content == "the answer"  # type: ignore[union-attr]
        again = await cli("dlq", "list")
        assert handle.turn_id not in again.stdout
        as_json = await cli("dlq", "list", "--json")
        assert as_json.returncode == 0, as_json.stderr
        assert all(json.loads(line)["id"] for line in as_json.stdout.splitlines())
        missing = await cli("dlq", "replay", "no-such-id")
        assert missing.returncode == 5
        assert missing.stderr.startswith("error: no dead-lettered message")
    finally:
        first.close()
        await handle.close()


async def test_cli_dlq_replays_a_dead_child_request_as_the_worker_vouched_for_it(
    client: LoopwireClient, scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    """A child turn's request is taken only from a worker's user; one dead-lettered (its agent
    not loaded yet) keeps the worker's ``user_id`` through ``dlq replay`` and runs."""
    scripted_model.respond_with(lambda _body: Reply.text("the child's answer"))
    parent = TurnParent(session_id=new_id(), turn_id=new_id(), call_id="call_1", root_turn_id="r")
    child = TurnRequest(
        turn_id=child_turn_id(parent.turn_id, parent.call_id),
        session_id=new_id(),
        agent="late",
        input=(InputMessage(content="hello"),),
        parent=parent,
    )
    first = WorkerProcess(
        model_url=scripted_model.base_url, agents_file=write_agents(tmp_path / "a.json", [])
    )
    async with first:
        await client.channel.default_exchange.publish(
            aio_pika.Message(
                encode(child),
                headers={t.H_KIND: t.KIND_START},
                message_id=child.turn_id,
                user_id=URL(AMQP_URL).user,  # as a worker publishes it (the tests' worker user)
            ),
            routing_key=t.TURNS_QUEUE,
        )
        for _ in range(100):
            listed = await cli("dlq", "list")
            rows = [line for line in listed.stdout.splitlines() if child.turn_id in line]
            if rows:
                break
            await asyncio.sleep(0.1)
        assert rows and "unknown_agent" in rows[0], listed.stdout
    agents = tmp_path / "b.json"
    agents.write_text(json.dumps({"agents": [{"name": "late", "tools": []}]}))
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents):
        completed: list[Event] = []

        async def watch() -> None:
            async for event in client.subscribe(f"turn.completed.*.{child.turn_id}"):
                completed.append(event)
                return

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.3)
        replayed = await cli("dlq", "replay", rows[0].split()[0])
        assert replayed.returncode == 0, replayed.stderr
        await asyncio.wait_for(watcher, 30)
    assert completed[0].data.result.content == "the child's answer"  # type: ignore[union-attr]
    again = await cli("dlq", "list")
    assert child.turn_id not in again.stdout, "the replay was taken, not refused as forbidden"


async def run_demo(*command: str, tmpdir: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The demo as a user runs it, against the test broker and Redis, with no model set
    (``tmpdir``: where its temporary files go)."""
    env = {**os.environ, "LOOPWIRE_AMQP_URL": AMQP_URL, "LOOPWIRE_REDIS_URL": REDIS_URL}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    env.pop("LOOPWIRE_MODEL__BASE_URL", None)
    return await asyncio.to_thread(
        subprocess.run,
        list(command),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


async def test_demo_runs_end_to_end(topology: None, tmp_path: Path) -> None:
    out = await run_demo("bash", "scripts/demo", tmpdir=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "local scripted demo model" in out.stdout
    assert "tool.invoked" in out.stdout
    answer = next(line for line in out.stdout.splitlines() if line.startswith("answer: "))
    assert "17 * 23 = 391" in answer
    leftovers = await asyncio.to_thread(lambda: list(tmp_path.glob("loopwire-demo-*")))
    assert leftovers == []  # its logs went with it


async def test_demo_runs_the_turn_through_the_http_gateway(topology: None) -> None:
    out = await run_demo(sys.executable, "-m", "worker.cli", "demo", "--http")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line.strip() for line in out.stdout.splitlines()]
    events = [line.split(": ", 1)[1] for line in lines if line.startswith("event: ")]
    assert events[0] == "metadata" and events[-1] == "end", events
    assert "the thread's state through the langgraph-sdk client:" in lines
    assert any(line.startswith("human: How does loopwire") for line in lines)
    answer = next(line for line in lines if line.startswith("answer: "))
    assert "17 * 23 = 391" in answer


@pytest.mark.parametrize(
    ("question", "route", "answer"),
    [
        ("How does loopwire keep a tool from running twice?", "support", "Our researcher reports:"),
        (
            "I was charged 2 * 19.99 instead of 19.99, refund please",
            "billing",
            "You are owed 39.98",
        ),
    ],
)
async def test_demo_runs_the_triage_workflow(
    topology: None, question: str, route: str, answer: str
) -> None:
    out = await run_demo(sys.executable, "-m", "worker.cli", "demo", "--workflow", question)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    # the classifier and the routed agent ran as children of the workflow turn
    assert any(line.split()[:2] == ["turn.completed", "classifier"] for line in lines)
    assert any(line.split()[:2] == ["turn.completed", route] for line in lines)
    researched = any(line.split()[:2] == ["turn.completed", "researcher"] for line in lines)
    assert researched == (route == "support"), "support asks the researcher; billing does not"
    final = next(line for line in lines if line.startswith("answer: "))
    assert final.startswith(f"answer: {answer}"), final


async def test_a_copy_published_while_the_turn_runs_gets_the_result_too(
    client: LoopwireClient,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "7"}), delay=1.0))
    scripted_model.expect(Reply.text("order 7 shipped"))
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=write_agents(tmp_path / "a.json", [lookup.name]),
    )
    await worker.start()
    try:
        first = await client.start_turn("support", "where is order 7?")
        await first.accepted(20)
        copy = await client.start_turn(
            "support",
            "where is order 7?",
            session_id=first.request.session_id,
            turn_id=first.turn_id,
        )
        results = [await first.result(30), await copy.result(30)]
        late = await client.start_turn(
            "support",
            "where is order 7?",
            session_id=first.request.session_id,
            turn_id=first.turn_id,
        )
        stored = await late.result(10)
        late_events = [e.type async for e in late.events()]
        for handle in (first, copy, late):
            await handle.close()
    finally:
        worker.close()
    assert [r.content for r in results] == ["order 7 shipped", "order 7 shipped"]
    assert stored == results[0], "a copy of a finished turn is answered from the stored result"
    assert late_events[-1] == "turn.completed", "and sees the turn end on the events exchange"
    assert sum(lookup.executions.values()) == 1
    assert worker.errors() == []


async def test_cli_dlq_refuses_to_replay_a_dead_step_and_keeps_it(
    client: LoopwireClient,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    tmp_path: Path,
) -> None:
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=write_agents(tmp_path / "a.json", [lookup.name]),
        extra_env={"LOOPWIRE_FAILPOINTS": "raise-step_begin", "LOOPWIRE_MAX_STEP_ATTEMPTS": "1"},
    )
    await worker.start()
    rows: list[str] = []

    async def dead_lettered() -> bool:
        listed = await cli("dlq", "list")
        rows[:] = [line for line in listed.stdout.splitlines() if result.turn_id in line]
        return bool(rows)

    try:
        result = await client.run_turn("support", "hello", timeout=30)
        # the turn's end is answered before its step is dead-lettered: wait for the letter
        await wait_until(dead_lettered, timeout=30)
    finally:
        worker.close()
    assert (result.finish_reason, result.error and result.error.code) == ("error", "step_failed")
    dead_id = rows[0].split()[0]

    refused = await cli("dlq", "replay", dead_id)

    assert refused.returncode == 2
    assert refused.stderr.startswith(f"error: not replayed: {dead_id} is step work of turn")
    assert "publish the turn's request anew" in refused.stderr
    assert dead_id in (await cli("dlq", "list")).stdout, "the letter stays"


def one_error(out: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


async def test_cli_controls_of_a_turn_that_does_not_exist_or_has_finished_exit_5(
    live: WorkerProcess, client: LoopwireClient
) -> None:
    ghost = new_id()
    for args, verb in (
        (("cancel", ghost), "cancel"),
        (("approve", ghost, "call-1"), "approve"),
        (("reject", ghost, "call-1"), "reject"),
    ):
        out = await cli(*args)
        assert out.returncode == 5, out.stderr
        assert one_error(out) == (
            f"error: no turn {ghost}: no worker has accepted a turn of that id, so there is "
            f"nothing to {verb}"
        )
        assert "published" not in out.stdout
    out = await cli("result", ghost)
    assert out.returncode == 5, out.stderr
    assert ghost in one_error(out)
    result = await client.run_turn("support", "hello", timeout=30)
    out = await cli("cancel", result.turn_id)
    assert out.returncode == 5, out.stderr
    assert one_error(out) == (
        f"error: turn {result.turn_id} has finished (stop): there is nothing to cancel"
    )


async def test_cli_a_turn_past_its_deadline_says_why_it_ended(live: WorkerProcess) -> None:
    out = await cli("turn", "hello", "--agent", "support", "--deadline", "0.001")
    assert out.returncode == 3, out.stderr
    assert one_error(out).endswith(" cancelled: deadline")


async def test_cli_session_delete_answers_in_json(
    live: WorkerProcess, client: LoopwireClient
) -> None:
    result = await client.run_turn("support", "hello", timeout=30)
    out = await cli("session", "delete", result.session_id, "--yes", "--json")
    assert out.returncode == 0, out.stderr
    deleted = json.loads(out.stdout)
    assert deleted["session_id"] == result.session_id and deleted["deleted_keys"] > 0
    gone = await cli("session", "show", result.session_id, "--amqp-url", AMQP_URL)
    assert gone.returncode == 5
    assert one_error(gone) == f"error: no session {result.session_id}"


async def test_cli_a_json_body_is_dead_lettered_as_not_msgpack(live: WorkerProcess) -> None:
    marker = new_id()
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        body = json.dumps({"turn_id": marker, "agent": "support"}).encode()
        await channel.default_exchange.publish(
            aio_pika.Message(body, message_id=marker), routing_key=t.TURNS_QUEUE
        )
    async with asyncio.timeout(30):
        while True:  # until the worker has dead-lettered it
            listed = await cli("dlq", "list", "--json")
            assert listed.returncode == 0, listed.stderr
            rows = [json.loads(line) for line in listed.stdout.splitlines()]
            found = [r for r in rows if r["turn_id"] == marker]
            if found:
                break
    assert found[0]["code"] == "malformed"
    assert found[0]["reason"].startswith("not msgpack: the body is JSON")
