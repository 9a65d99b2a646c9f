"""Controlling turns from outside over the real broker and Redis: cancel a turn queued behind
another, one whose model call hangs, and a cancel whose worker dies before applying it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support_rpc import REDIS_URL

from contracts.client import LoopwireClient, new_id
from contracts.tools import ToolCallRequest
from harness import (
    SURVIVOR_ENV,
    CountingToolService,
    EventRecorder,
    WorkerProcess,
    run_past_a_crash,
    write_agents,
)
from worker.cli.main import main as cli
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration


def worker_for(tmp_path: Path, model: ScriptedModel, tools: list[str], **env: str) -> WorkerProcess:
    agents = write_agents(tmp_path / "agents.json", tools)
    return WorkerProcess(model_url=model.base_url, agents_file=agents, extra_env=env)


async def test_a_turn_queued_behind_another_is_cancelled_at_once_and_never_runs(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.text("first answer", delay=3.0))
    session = new_id()
    async with worker_for(tmp_path, scripted_model, [lookup.name]) as worker:
        first = await client.start_turn("support", "one", session_id=session)
        await first.accepted(20)
        second = await client.start_turn("support", "two", session_id=session)
        await second.accepted(20)
        await scripted_model.wait_for_requests(1, timeout=20)
        started = time.monotonic()
        await second.cancel("user changed their mind", by="test")
        cancelled = await second.result(20)
        waited = time.monotonic() - started
        answered = await first.result(30)
        await first.close()
        await second.close()
    assert worker.errors() == []
    assert (cancelled.finish_reason, cancelled.stopped_by) == (
        "cancelled",
        "user changed their mind",
    )
    assert cancelled.steps == 0 and cancelled.content is None
    assert waited < 2.5, "ended at once, not after the turn ahead of it"
    assert answered.content == "first answer"
    assert len(scripted_model.requests) == 1, "the cancelled turn never reached the model"
    await events.wait_for(lambda evs: any(e.type == "turn.cancelled" for e in evs))
    types = [e.type for e in events.for_turn(second.turn_id)]
    assert types == ["turn.accepted", "turn.cancelled"]


async def test_a_turn_whose_model_call_hangs_is_cancelled_within_a_lease_renewal(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "order 7"}), content="Checking."))
    scripted_model.expect(Reply.text("never sent", delay=40.0))
    async with worker_for(tmp_path, scripted_model, [lookup.name]) as worker:
        handle = await client.start_turn("support", "where is order 7?")
        await scripted_model.wait_for_requests(2, timeout=20)
        started = time.monotonic()
        # the CLI, as an operator would: only the turn id
        code = await asyncio.to_thread(
            cli, ["--amqp-url", client.amqp_url, "cancel", handle.turn_id, "--reason", "operator"]
        )
        result = await handle.result(20)
        waited = time.monotonic() - started
        await asyncio.sleep(1.5)  # nothing more happens for the turn
        await handle.close()
    assert code == 0
    assert worker.errors() == []
    # the test workers' lease lasts 3 s and is renewed every second
    assert waited < 4.0, f"the hanging call was abandoned after {waited:.1f}s"
    assert (result.finish_reason, result.stopped_by) == ("cancelled", "operator")
    assert result.content == "Checking."
    assert result.steps == 1
    assert len(scripted_model.requests) == 2, "the model was not asked again"
    assert sum(lookup.executions.values()) == 1
    await events.wait_for(lambda evs: any(e.type == "turn.cancelled" for e in evs))
    types = [e.type for e in events.for_turn(handle.turn_id)]
    assert types[-1] == "turn.cancelled" and types.count("turn.cancelled") == 1


async def test_a_cancel_whose_worker_dies_after_recording_it_is_applied_by_another(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.respond_with(lambda request: Reply.text("answer", delay=2.0))
    session = new_id()
    doomed = worker_for(
        tmp_path, scripted_model, [lookup.name], LOOPWIRE_FAILPOINTS="cancel_recorded"
    )
    survivor = worker_for(tmp_path, scripted_model, [lookup.name])
    await doomed.start()
    try:
        first = await client.start_turn("support", "one", session_id=session)
        await first.accepted(20)
        second = await client.start_turn("support", "two", session_id=session)
        await second.accepted(20)
        await client.cancel(second.turn_id, "too slow")  # no session: found from the turn id
        assert doomed.proc is not None
        await asyncio.to_thread(doomed.proc.wait, 20)
        await survivor.start()
        cancelled = await second.result(30)
        answered = await first.result(30)
        await first.close()
        await second.close()
    finally:
        doomed.close()
        survivor.close()
    assert "failpoint cancel_recorded" in doomed.stderr()
    assert (cancelled.finish_reason, cancelled.stopped_by) == ("cancelled", "too slow")
    assert answered.content == "answer"
    assert all("two" not in str(r["messages"]) for r in scripted_model.requests)


def approving_agents(tmp_path: Path, tool: str, timeout_s: float = 3600) -> Path:
    path = tmp_path / "agents.json"
    agent = {"name": "support", "tools": [tool], "approval": [tool]}
    agent["approval_timeout_s"] = timeout_s  # type: ignore[assignment]
    path.write_text(json.dumps({"agents": [agent]}))
    return path


async def test_an_approval_survives_the_worker_that_parked_it_and_runs_the_edited_call(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refund 100"}), content="Asking."))
    scripted_model.expect(Reply.text("Refunded 20."))
    agents = approving_agents(tmp_path, lookup.name)
    first = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    second = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    await first.start()
    try:
        handle = await client.start_turn("support", "refund me")
        requested = await anext(handle.approvals())
        first.kill()  # parked: nothing of the turn is in the dead worker
        listed = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "worker.cli", "approvals", "--json"],
            env={**os.environ, "LOOPWIRE_REDIS_URL": REDIS_URL},
            capture_output=True,
            check=True,
            timeout=30,
        )
        await second.start()
        call_id = requested.data.call_id  # type: ignore[union-attr]
        code = await asyncio.to_thread(
            cli,
            [
                "--amqp-url",
                client.amqp_url,
                "approve",
                handle.turn_id,
                call_id,
                "--arguments",
                '{"q": "refund 20"}',
                "--by",
                "maria",
            ],
        )
        result = await handle.result(30)
        await handle.close()
    finally:
        first.close()
        second.close()
    assert code == 0
    waiting = [json.loads(line) for line in listed.stdout.decode().splitlines()]
    assert any(w["turn_id"] == handle.turn_id and w["call_id"] == call_id for w in waiting)
    assert requested.data.tool == lookup.name  # type: ignore[union-attr]
    assert json.loads(requested.data.arguments) == {"q": "refund 100"}  # type: ignore[union-attr]
    assert result.content == "Refunded 20."
    assert list(lookup.executions) and sum(lookup.executions.values()) == 1
    [seen] = [m["content"] for m in scripted_model.requests[1]["messages"] if m["role"] == "tool"]
    assert "found refund 20" in seen, "the call ran with the edited arguments"
    await events.wait_for(lambda evs: any(e.type == "approval.decided" for e in evs))
    [decided] = [e for e in events.for_turn(handle.turn_id) if e.type == "approval.decided"]
    assert (decided.data.decision, decided.data.by) == ("edit", "maria")  # type: ignore[union-attr]


async def test_a_call_left_undecided_is_rejected_when_its_wait_times_out(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refund"})))
    scripted_model.expect(Reply.text("Nobody approved it."))
    worker = WorkerProcess(
        model_url=scripted_model.base_url, agents_file=approving_agents(tmp_path, lookup.name, 3)
    )
    async with worker:
        started = time.monotonic()
        result = await client.run_turn("support", "refund me", timeout=30)
        waited = time.monotonic() - started
    assert worker.errors() == []
    assert result.content == "Nobody approved it."
    assert 2.0 <= waited < 10, waited
    assert sum(lookup.executions.values()) == 0
    [seen] = [m["content"] for m in scripted_model.requests[1]["messages"] if m["role"] == "tool"]
    assert "rejected by timeout: no decision within" in seen


async def test_a_parked_turn_is_cancelled_at_once(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refund"}), content="Asking."))
    worker = WorkerProcess(
        model_url=scripted_model.base_url, agents_file=approving_agents(tmp_path, lookup.name)
    )
    async with worker:
        handle = await client.start_turn("support", "refund me")
        await anext(handle.approvals())
        started = time.monotonic()
        await handle.cancel("no longer needed")
        result = await handle.result(20)
        waited = time.monotonic() - started
        await handle.close()
    assert worker.errors() == []
    assert waited < 2.0
    assert (result.finish_reason, result.stopped_by, result.content) == (
        "cancelled",
        "no longer needed",
        "Asking.",
    )
    assert sum(lookup.executions.values()) == 0
    assert len(scripted_model.requests) == 1
    await events.wait_for(lambda evs: any(e.type == "turn.cancelled" for e in evs))
    types = [e.type for e in events.for_turn(handle.turn_id)]
    assert types[-1] == "turn.cancelled" and "approval.requested" in types
    assert "approval.decided" not in types and "tool.invoking" not in types


@pytest.mark.parametrize("point", ["parked", "decision_recorded", "resumed"])
async def test_a_worker_killed_while_parking_deciding_or_resuming_loses_nothing(
    point: str,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refund"})))
    scripted_model.expect(Reply.text("Refunded."))
    agents = approving_agents(tmp_path, lookup.name)
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
        handle = await client.start_turn("support", "refund me")
        if point == "parked":  # dies before it announces: the next worker announces it
            assert doomed.proc is not None
            await asyncio.to_thread(doomed.proc.wait, 20)
            await survivor.start()
        requested = await asyncio.wait_for(anext(handle.approvals()), 20)
        await handle.decide(requested.data.call_id, "approve", by="maria")  # type: ignore[union-attr]
        if point != "parked":
            assert doomed.proc is not None
            await asyncio.to_thread(doomed.proc.wait, 20)
            await survivor.start()
        result = await handle.result(30)
        await handle.close()
    finally:
        doomed.close()
        survivor.close()
    assert f"failpoint {point}" in doomed.stderr()
    assert result.content == "Refunded."
    assert sum(lookup.executions.values()) == 1, "the approved call ran once"
    assert len(scripted_model.requests) == 2, "no model call was made twice"


DEADLINE_S = 6.0
"""Room enough for the call to go out before the deadline on a loaded machine."""


@pytest.mark.parametrize("slow", ["model", "tool"])
async def test_a_turn_past_its_deadline_ends_as_cancelled_while_its_call_is_still_out(
    slow: str,
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    release = asyncio.Event()
    called = asyncio.Event()

    async def slow_tool(request: ToolCallRequest) -> object:
        called.set()
        await release.wait()
        return {"results": ["too late"]}

    service = CountingToolService(f"slow_{uuid.uuid4().hex[:8]}", slow_tool, timeout_s=30)
    await service.start()
    if slow == "model":
        scripted_model.expect(Reply.text("too late", delay=60.0))
    else:
        scripted_model.expect(Reply.tool_calls((service.name, {"q": "x"}), content="Looking."))
    try:
        async with worker_for(tmp_path, scripted_model, [service.name]) as worker:
            deadline = time.time() + DEADLINE_S
            handle = await client.start_turn("support", "quick!", deadline=deadline)
            if slow == "model":
                await scripted_model.wait_for_requests(1, timeout=DEADLINE_S)
            else:
                await asyncio.wait_for(called.wait(), DEADLINE_S)
            assert time.time() < deadline, "the call went out only after the deadline"
            result = await handle.result(30)
            await handle.close()
    finally:
        release.set()
        await service.stop()
    assert worker.errors() == []
    assert (result.finish_reason, result.stopped_by) == ("cancelled", "deadline")
    # ended by the deadline, not by the call (it never came back) nor by a timeout
    assert deadline <= result.completed_at < deadline + 5.0, result.completed_at - deadline
    assert len(scripted_model.requests) == 1
    if slow == "tool":
        assert result.content == "Looking."


async def test_a_model_that_calls_tools_forever_is_stopped_by_its_budget_with_an_answer(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    def responder(request: dict[str, Any]) -> Reply:
        if not request.get("tools"):
            return Reply.text("Here is what I found.")
        return Reply.tool_calls((lookup.name, {"q": "more"}))

    scripted_model.respond_with(responder)
    path = tmp_path / "agents.json"
    agent = {"name": "support", "tools": [lookup.name], "budget": {"max_tool_calls": 3}}
    path.write_text(json.dumps({"agents": [agent]}))
    prices = json.dumps({"test-model": {"input_per_m": 1000.0, "output_per_m": 1000.0}})
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=path,
        extra_env={"LOOPWIRE_PRICES": prices, "LOOPWIRE_MODEL__MODEL": "test-model"},
    )
    async with worker:
        result = await client.run_turn("support", "find everything", timeout=30)
        url = f"http://127.0.0.1:{worker.port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            metrics = await response.text()
    assert worker.errors() == []
    assert (result.finish_reason, result.stopped_by) == ("budget", "turn.max_tool_calls")
    assert result.content == "Here is what I found."
    assert len(scripted_model.requests) == 4 and sum(lookup.executions.values()) == 3
    assert result.cost_usd == pytest.approx(result.usage.total_tokens * 1000 / 1e6)
    assert result.cost_usd > 0
    assert (
        'loopwire_budget_exhausted_total{agent="support",budget="turn.max_tool_calls"} 1.0'
        in metrics
    )


async def test_a_429_storm_parks_turns_instead_of_filling_the_workers_with_sleeping_steps(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    """Two workers, a model that answers 429 (Retry-After: 2) to every tenth call: every turn
    completes, each throttled turn waited at least the Retry-After, and while the throttled
    turns waited no worker held a step."""
    calls = 0
    throttled_at: dict[str, float] = {}
    waited: list[float] = []
    retried_at: list[float] = []

    def responder(request: dict[str, Any]) -> Reply:
        nonlocal calls
        calls += 1
        question = request["messages"][-1]["content"]
        if question in throttled_at:
            retried_at.append(time.monotonic())
            waited.append(retried_at[-1] - throttled_at[question])
        elif calls % 10 == 0:
            throttled_at[question] = time.monotonic()
            return Reply.error(429, "slow down", headers={"Retry-After": "2"})
        return Reply.text("answered")

    scripted_model.respond_with(responder)
    agents = write_agents(tmp_path / "agents.json", [])
    workers = [
        WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) for _ in range(2)
    ]
    samples: list[tuple[float, float]] = []

    async def in_progress() -> None:
        async with aiohttp.ClientSession() as http:
            while True:
                total = 0.0
                for worker in workers:
                    url = f"http://127.0.0.1:{worker.port}/metrics"
                    async with http.get(url) as response:
                        for line in (await response.text()).splitlines():
                            if line.startswith("loopwire_steps_in_progress "):
                                total += float(line.split()[1])
                samples.append((time.monotonic(), total))
                await asyncio.sleep(0.1)

    for worker in workers:
        await worker.start()
    sampler = asyncio.create_task(in_progress())
    try:
        finished_at: list[float] = []

        async def one(n: int) -> Any:
            result = await client.run_turn("support", f"question {n}", timeout=60)
            finished_at.append(time.monotonic())
            return result

        results = await asyncio.gather(*(one(n) for n in range(25)))
    finally:
        sampler.cancel()
        for worker in workers:
            worker.close()
    assert all(r.finish_reason == "stop" and r.content == "answered" for r in results)
    assert len(throttled_at) >= 2, "the storm happened"
    assert calls == 25 + len(throttled_at), "each throttled call was made once more, no more"
    assert len(waited) == len(throttled_at)
    assert min(waited) >= 2.0, f"each throttled turn waited its Retry-After: {waited}"
    # between the last turn not throttled finishing and the first retry, only parked turns
    # were left: no worker held a step
    others_done = sorted(finished_at)[25 - len(throttled_at) - 1]
    window = [n for at, n in samples if others_done + 0.15 < at < min(retried_at) - 0.15]
    assert len(window) >= 3, "the sampler saw the parked turns wait"
    assert set(window) == {0.0}, window
    assert all(w.errors() == [] for w in workers)


async def test_a_turn_throttled_by_a_worker_that_died_before_announcing_it_is_announced(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    """The worker that parks a turn for a 429 dies right after the save, before it announces
    ``turn.throttled``: the worker that takes the redelivered step message announces it (the
    same event: its time and id are the wait's), and the turn completes after its wait."""
    calls = 0

    def responder(request: dict[str, Any]) -> Reply:
        nonlocal calls
        calls += 1
        if calls == 1:
            return Reply.error(429, "slow down", headers={"Retry-After": "1"})
        return Reply.text("answered")

    scripted_model.respond_with(responder)
    agents = write_agents(tmp_path / "agents.json", [])
    recorder = EventRecorder()
    await recorder.start()
    try:
        result, survivor = await run_past_a_crash(
            client, scripted_model.base_url, agents, "parked", "support", "question"
        )
        await recorder.wait_for(
            lambda events: any(
                e.type == "turn.completed" for e in events if e.turn_id == result.turn_id
            )
        )
    finally:
        await recorder.stop()
    assert result.finish_reason == "stop" and result.content == "answered"
    assert calls == 2, "the throttled call was made once more, no more"
    throttled = [e for e in recorder.for_turn(result.turn_id) if e.type == "turn.throttled"]
    assert throttled, "the throttle was never announced"
    assert len({e.id for e in throttled}) == 1, "every announcement is the same event"
    assert throttled[0].data.until >= throttled[0].time + 1.0  # type: ignore[union-attr]
    assert survivor.errors() == []
