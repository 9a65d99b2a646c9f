"""Workers dying at every point of a step, and many turns over two workers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from support_rpc import wait_until

from contracts import keys
from contracts.client import LoopwireClient, TurnHandle, new_id
from contracts.dead_letters import list_dead
from contracts.registry import live_tools
from harness import (
    AMQP_URL,
    REDIS_URL,
    SURVIVOR_ENV,
    CountingToolService,
    EventRecorder,
    WorkerProcess,
    assert_valid_transcript,
    session_history,
    step_records,
    write_agents,
)
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "point",
    [
        "model_saved",
        "tool_dispatched",
        "tool_result_saved",
        "step_recorded",
        "step_saved",
        "before_ack",
    ],
)
async def test_killed_worker_step_is_redone_by_another(
    point: str,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refund"})))
    scripted_model.expect(Reply.text("Refunds take 5 days."))
    agents = write_agents(tmp_path / "agents.json", [lookup.name])
    doomed = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents,
        extra_env={"LOOPWIRE_FAILPOINTS": point},
    )
    survivor = WorkerProcess(
        model_url=scripted_model.base_url, agents_file=agents, extra_env=SURVIVOR_ENV
    )
    await doomed.start()
    try:
        session = new_id()
        handle = await client.start_turn("support", "refund time?", session_id=session)
        assert await doomed.exited() == 137
        await survivor.start()
        result = await handle.result(30)
        await handle.close()
    finally:
        doomed.close()
        survivor.close()
    assert result.finish_reason == "stop"
    assert result.content == "Refunds take 5 days."
    assert sum(lookup.executions.values()) == 1, "a tool ran twice"
    assert len(scripted_model.requests) == 2, "a saved model response was requested again"
    messages = await session_history(session)
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert_valid_transcript(messages)
    records = await step_records(session, result.turn_id)
    assert [r.step.index for r in records] == [0, 1], "a step recorded twice, or lost"
    assert [e.outcome for e in records[0].step.tool_executions] == ["ok"]
    assert survivor.errors() == []


async def test_many_turns_over_two_workers_keep_session_order(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    def responder(request: dict[str, Any]) -> Reply:
        messages = request["messages"]
        last_user = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        if messages[-1]["role"] == "user":
            return Reply.tool_calls((lookup.name, {"q": last_user}))
        return Reply.text(f"answer to {last_user}")

    scripted_model.respond_with(responder)
    agents = write_agents(tmp_path / "agents.json", [lookup.name])
    workers = [
        WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) for _ in range(2)
    ]
    recorder = EventRecorder("turn.completed.#")
    await recorder.start()
    await asyncio.gather(*(w.start() for w in workers))
    sessions = [new_id() for _ in range(10)]
    handles: dict[str, list[TurnHandle]] = defaultdict(list)

    async def publish_session(session: str) -> None:
        for turn in range(5):
            text = f"{session[:6]} question {turn}"
            handle = await client.start_turn("support", text, session_id=session)
            handles[session].append(handle)
            # the next turn of a session is published once this one is accepted
            await handle.accepted(30)

    try:
        await asyncio.gather(*(publish_session(s) for s in sessions))
        results = {h.turn_id: await h.result(90) for hs in handles.values() for h in hs}
        await recorder.wait_for(
            lambda evs: sum(e.session_id in sessions for e in evs) >= 50, timeout=30
        )
        await asyncio.sleep(0.5)  # a duplicate completion would arrive now
    finally:
        for worker in workers:
            worker.close()
        for hs in handles.values():
            for h in hs:
                await h.close()
        await recorder.stop()
    assert len(results) == 50
    assert all(r.finish_reason == "stop" for r in results.values())
    completed = [e.turn_id for e in recorder.events if e.session_id in sessions]
    assert sorted(completed) == sorted(results), "every turn completes exactly once"
    for session in sessions:
        order = [e.turn_id for e in recorder.events if e.session_id == session]
        assert order == [h.turn_id for h in handles[session]], "turns of a session ran out of order"
        messages = await session_history(session)
        users = [m.content for m in messages if m.role == "user"]
        assert users == [f"{session[:6]} question {turn}" for turn in range(5)]
        assert_valid_transcript(messages)
        answers = [m.content for m in messages if m.role == "assistant" and m.content]
        assert answers == [f"answer to {u}" for u in users]
    assert sum(lookup.executions.values()) == 50
    assert all(w.errors() == [] for w in workers)


async def test_step_that_keeps_failing_fails_its_turn_and_frees_the_session(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    agents = write_agents(tmp_path / "agents.json", [lookup.name])
    broken = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents,
        extra_env={"LOOPWIRE_FAILPOINTS": "raise-step_begin", "LOOPWIRE_MAX_STEP_ATTEMPTS": "2"},
    )
    await broken.start()
    session = new_id()
    listed: list[Any] = []

    async def dead_lettered() -> bool:
        listed[:] = [d for d in await list_dead(AMQP_URL) if d.turn_id == failed.turn_id]
        return bool(listed)

    try:
        failed = await client.run_turn("support", "first", session_id=session, timeout=30)
        # the turn's end is answered before its step is dead-lettered: wait for the letter
        await wait_until(dead_lettered, timeout=30)
    finally:
        broken.close()
    assert failed.finish_reason == "error"
    assert failed.error is not None
    assert failed.error.code == "step_failed"
    assert "failpoint step_begin" in failed.error.message
    # the dead letter keeps the step message and its reason
    assert [d.code for d in listed] == ["step_failed"]
    # the session is not blocked: its next turn runs on a healthy worker
    scripted_model.expect(Reply.text("second answer"))
    healthy = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    await healthy.start()
    try:
        second = await client.run_turn("support", "second", session_id=session, timeout=30)
    finally:
        healthy.close()
    assert second.content == "second answer"
    messages = await session_history(session)
    # the first turn failed before its first step began, so only the second is in the history
    assert failed.steps == 0
    assert [m.content for m in messages if m.role == "user"] == ["second"]


@pytest.mark.parametrize("point", ["tool_dispatched", "tool_result_saved"])
async def test_crash_with_the_real_notes_service_files_one_note(
    point: str, scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    """End to end with a real SDK tool service (not a test double): the non-idempotent notes
    tool files exactly one note although its worker died around the call."""
    env = {**os.environ, "LOOPWIRE_AMQP_URL": AMQP_URL, "LOOPWIRE_REDIS_URL": REDIS_URL}
    log = (tmp_path / "notes.log").open("wb")
    notes = subprocess.Popen(
        [sys.executable, "-m", "tool_services.notes"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    redis = Redis.from_url(REDIS_URL)
    try:
        for _ in range(200):
            if "file_note" in await live_tools(redis):
                break
            await asyncio.sleep(0.05)
        scripted_model.expect(Reply.tool_calls(("file_note", {"text": "call the customer back"})))
        scripted_model.expect(Reply.text("noted"))
        agents = write_agents(tmp_path / "agents.json", ["file_note"])
        doomed = WorkerProcess(
            model_url=scripted_model.base_url,
            agents_file=agents,
            extra_env={"LOOPWIRE_FAILPOINTS": point},
        )
        survivor = WorkerProcess(
            model_url=scripted_model.base_url, agents_file=agents, extra_env=SURVIVOR_ENV
        )
        await doomed.start()
        session = new_id()
        try:
            handle = await client.start_turn("support", "note it", session_id=session)
            assert await doomed.exited() == 137
            await survivor.start()
            result = await handle.result(30)
            await handle.close()
        finally:
            doomed.close()
            survivor.close()
        assert result.content == "noted"
        assert await redis.llen(keys.session_notes(session)) == 1  # type: ignore[misc]
        tool_text = [m.content for m in await session_history(session) if m.role == "tool"]
        assert len(tool_text) == 1
        assert '"filed": true' in (tool_text[0] or "")
    finally:
        notes.terminate()
        notes.wait(30)
        log.close()
        await redis.aclose()
