"""Metrics and health as an operator sees them: ``/metrics`` scraped over HTTP from a live
worker and a live tool service after real turns, and ``/livez`` / ``/readyz`` following Redis.

The first tests run the loop in this process (no broker) to show the observer's view of tool
outcomes a distributed turn cannot easily produce (a hook blocking a call); the rest talk to
the real RabbitMQ and Redis through worker and tool service subprocesses.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis
from support_rpc import wait_announced

from contracts.client import LoopwireClient
from contracts.events import EVENT_TYPES
from contracts.tools import ToolCallReply, ToolCallRequest, ToolContext, ToolDefinition
from contracts.turns import InputMessage, LoopLimits, TurnRequest
from harness import (
    CountingToolService,
    EventRecorder,
    WorkerProcess,
    duplicate_and_garbage,
    free_port,
    session_history,
    write_agents,
)
from worker.errors import ToolUnavailableError
from worker.loop import Blocked, Hook, HookContext, Loop, ToolInvocation
from worker.loop.ports import LoopObserver
from worker.model.adapter import OpenAIModel
from worker.profiles.agents import AgentProfile
from worker.runtime.metrics import WorkerMetrics, package_version
from worker.testing.memory import FunctionTools, ListSink, MemoryStore, StaticCatalog
from worker.testing.scripted_model import Reply, ScriptedModel

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
HINT_TAIL = LoopLimits().empty_streak_hint.split(":count", 1)[1].strip()[:30]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def label_values(samples: Samples) -> set[str]:
    return {v for _, labels in samples for _, v in labels}


async def get(port: int, path: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}", timeout=aiohttp.ClientTimeout(5)) as r,
    ):
        return r.status, await r.text()


async def scrape(port: int) -> Samples:
    status, text = await get(port, "/metrics")
    assert status == 200
    return parse(text)


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.1)


async def answers(port: int, path: str, status: int, text: str = "") -> bool:
    try:
        got, body = await get(port, path)
    except aiohttp.ClientError:
        return False
    return got == status and text in body


# -- the observer, in process ------------------------------------------------------------------


class _Tools(FunctionTools):
    """In-process tools; ``gone`` has no service (as a ToolRPC with nothing bound)."""

    async def call(self, request: ToolCallRequest, definition: ToolDefinition) -> ToolCallReply:
        if request.tool == "gone":
            raise ToolUnavailableError("tool unavailable: no service is bound for 'gone'")
        return await super().call(request, definition)


class _BlockSecrets(Hook):
    async def before_tool(self, ctx: HookContext, call: ToolInvocation) -> ToolInvocation | Blocked:
        return Blocked("secrets are off limits") if call.name == "secret" else call


def _definition(name: str, timeout_s: float = 5.0) -> ToolDefinition:
    return ToolDefinition(
        name=name, description=name, parameters={"type": "object"}, timeout_s=timeout_s
    )


async def test_observer_tells_tool_outcomes_apart(scripted_model: ScriptedModel) -> None:
    async def ok(args: dict[str, Any], ctx: ToolContext) -> object:
        return {"results": ["x"]}

    async def slow(args: dict[str, Any], ctx: ToolContext) -> object:
        await asyncio.sleep(5)
        return {}

    async def broken(args: dict[str, Any], ctx: ToolContext) -> object:
        raise RuntimeError("boom")

    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, default_model="scripted-model")
    client = openai.AsyncOpenAI(base_url=scripted_model.base_url, api_key="x", max_retries=0)
    functions = {"ok": ok, "slow": slow, "broken": broken, "secret": ok, "gone": ok}
    definitions = [_definition(n, 0.3 if n == "slow" else 5.0) for n in functions]
    loop = Loop(
        model=OpenAIModel(client, model="scripted-model"),
        tools=_Tools(functions),
        catalog=StaticCatalog(definitions),
        store=MemoryStore(),
        events=ListSink(),
        hooks=_BlockSecrets(),
        observer=metrics,
    )
    names = ("ok", "slow", "broken", "secret", "gone", "invented")
    calls: list[tuple[str, dict[str, object]]] = [(name, {}) for name in names]
    scripted_model.expect(Reply.tool_calls(*calls))
    scripted_model.expect(Reply.text("done"))
    request = TurnRequest(
        turn_id="t1", session_id="s1", agent="support", input=(InputMessage(content="hi"),)
    )
    try:
        result = (await loop.run_turn(None, request, AgentProfile(name="support"))).result
    finally:
        await client.close()
    assert result.finish_reason == "stop"
    samples = parse(generate_latest(registry).decode())
    outcomes = {
        (dict(labels)["tool"], dict(labels)["outcome"]): v
        for (name, labels), v in samples.items()
        if name == "loopwire_tool_call_duration_seconds_count"
    }
    assert outcomes == {
        ("ok", "ok"): 1,
        ("slow", "timeout"): 1,
        ("broken", "error"): 1,
        ("secret", "blocked"): 1,
        ("gone", "unavailable"): 1,
        ("_unknown", "error"): 1,
    }
    assert "invented" not in label_values(samples)
    assert value(samples, "loopwire_turns_finished_total", agent="support", finish_reason="stop")
    assert value(samples, "loopwire_step_duration_seconds_count", agent="support") == 2


async def test_a_failing_observer_never_changes_the_turn(scripted_model: ScriptedModel) -> None:
    class Broken(LoopObserver):
        def model_called(self, *args: Any) -> None:
            raise RuntimeError("observer bug")

        def turn_finished(self, *args: Any) -> None:
            raise RuntimeError("observer bug")

    client = openai.AsyncOpenAI(base_url=scripted_model.base_url, api_key="x", max_retries=0)
    loop = Loop(
        model=OpenAIModel(client, model="scripted-model"),
        tools=FunctionTools({}),
        catalog=StaticCatalog(),
        store=MemoryStore(),
        events=ListSink(),
        observer=Broken(),
    )
    scripted_model.expect(Reply.text("still fine"))
    request = TurnRequest(
        turn_id="t1", session_id="s1", agent="support", input=(InputMessage(content="hi"),)
    )
    try:
        result = (await loop.run_turn(None, request, AgentProfile(name="support"))).result
    finally:
        await client.close()
    assert result.content == "still fine"


# -- a live worker and tool service ------------------------------------------------------------


@pytest.mark.integration
async def test_metrics_change_as_expected_after_real_turns(
    topology: None,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    spawn: Any,
    redis: Redis,
    uid: str,
    tmp_path: Path,
) -> None:
    async def sleepy(request: ToolCallRequest) -> object:
        await asyncio.sleep(1.0)
        return {"results": ["late"]}

    async def never(request: ToolCallRequest) -> object:
        raise AssertionError("an unbound tool cannot be called")

    slow = CountingToolService(f"slow_{uid}", sleepy, timeout_s=0.5)
    gone = CountingToolService(f"gone_{uid}", never, bind=False)
    await slow.start()
    await gone.start()
    tools_port = free_port()
    calculator = await spawn(
        "tool_services.calculator",
        tool="calculate",
        env={"LOOPWIRE_TOOLS__HTTP_PORT": str(tools_port)},
    )
    agents = write_agents(
        tmp_path / "agents.json",
        ["calculate", lookup.name, slow.name, gone.name],
        max_tool_iterations=2,
        empty_streak_after=1,
    )
    worker = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    session = f"s-{uid}"
    try:
        await wait_announced(redis, "calculator")
        await eventually(lambda: answers(tools_port, "/readyz", 200))
        await worker.start()
        w0, c0 = await scrape(worker.port), await scrape(tools_port)

        scripted_model.expect(
            Reply.tool_calls(
                ("calculate", {"expression": "6*7"}),
                (lookup.name, {"q": "nothing"}),
                ("made_up_tool", {}),
                (gone.name, {"q": "x"}),
                (slow.name, {"q": "x"}),
            )
        )
        scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refunds"})))
        scripted_model.expect(Reply.text("Refunds take 5 days.", usage=(11, 3)))
        scripted_model.expect(Reply.error(500))
        capped = await client.run_turn("support", "6*7?", session_id=session, timeout=30)
        handle = await client.start_turn("support", "refunds?", session_id=session)
        answered = await handle.result(30)
        failed = await client.run_turn("support", "again", session_id=session, timeout=30)
        await duplicate_and_garbage(client, handle)

        async def transport_counted() -> bool:
            s = await scrape(worker.port)
            return (
                value(s, "loopwire_dead_lettered_total", reason="malformed") == 1
                and value(s, "loopwire_work_dropped_total", reason="duplicate_request") == 1
            )

        await eventually(transport_counted)
        w1, c1 = await scrape(worker.port), await scrape(tools_port)
        history = await session_history(session)
    finally:
        worker.close()
        calculator.signal(signal.SIGTERM)
        await calculator.wait()
        await slow.stop()
        await gone.stop()
    assert worker.errors() == []
    assert (capped.finish_reason, answered.finish_reason, failed.finish_reason) == (
        "max_iterations",
        "stop",
        "error",
    )

    def delta(name: str, **labels: str) -> float:
        return value(w1, name, **labels) - value(w0, name, **labels)

    support = {"agent": "support"}
    # turns by outcome, steps per turn, turn and step duration, turns in progress
    assert delta("loopwire_turns_started_total", **support) == 3
    for reason in ("max_iterations", "stop", "error"):
        assert delta("loopwire_turns_finished_total", **support, finish_reason=reason) == 1
        assert delta("loopwire_turn_duration_seconds_count", **support, finish_reason=reason) == 1
    durations = sum(
        delta("loopwire_turn_duration_seconds_sum", **support, finish_reason=r)
        for r in ("max_iterations", "stop", "error")
    )
    assert durations == pytest.approx(capped.duration_s + answered.duration_s + failed.duration_s)
    assert delta("loopwire_turn_steps_count", **support) == 3
    # the failed turn counts the step whose model call failed
    assert (
        delta("loopwire_turn_steps_sum", **support) == capped.steps + answered.steps + failed.steps
    )
    assert failed.steps == 1
    assert delta("loopwire_step_duration_seconds_count", **support) == 3
    assert value(w1, "loopwire_steps_in_progress") == 0
    # model calls: duration, tokens by type, errors by type
    model = {
        "gen_ai_operation_name": "chat",
        "gen_ai_request_model": "scripted-model",
        "server_address": "default",
    }
    assert delta("gen_ai_client_operation_duration_seconds_count", **model, error_type="") == 3
    assert (
        delta(
            "gen_ai_client_operation_duration_seconds_count", **model, error_type="model_http_500"
        )
        == 1
    )
    inputs = delta("gen_ai_client_token_usage_sum", **model, gen_ai_token_type="input")
    outputs = delta("gen_ai_client_token_usage_sum", **model, gen_ai_token_type="output")
    assert inputs == capped.usage.prompt_tokens + answered.usage.prompt_tokens
    assert outputs == capped.usage.completion_tokens + answered.usage.completion_tokens
    assert delta("gen_ai_client_token_usage_count", **model, gen_ai_token_type="input") == 3
    assert (
        delta(
            "loopwire_model_errors_total",
            gen_ai_request_model="scripted-model",
            server_address="default",
            error_type="model_http_500",
        )
        == 1
    )
    # tool calls from the worker, by tool and outcome; invented names are not label values
    calls = "loopwire_tool_call_duration_seconds_count"
    assert delta(calls, tool="calculate", outcome="ok") == 1
    assert delta(calls, tool=lookup.name, outcome="ok") == 2
    assert delta(calls, tool="_unknown", outcome="error") == 1
    assert delta(calls, tool=gone.name, outcome="unavailable") == 1
    assert delta(calls, tool=slow.name, outcome="timeout") == 1
    assert "made_up_tool" not in label_values(w1)
    assert value(w1, "loopwire_tool_calls_in_progress", tool="calculate") == 0
    # guards: every hint the model read is counted, and the cap
    hints = sum(1 for m in history if m.role == "tool" and HINT_TAIL in (m.content or ""))
    assert hints == 4
    assert delta("loopwire_empty_streak_hints_total", **support) == hints
    assert delta("loopwire_iteration_caps_total", **support) == 1
    # transport: dead letters by reason, duplicates dropped, store latency, events
    assert delta("loopwire_dead_lettered_total", reason="malformed") == 1
    assert delta("loopwire_work_dropped_total", reason="duplicate_request") == 1
    store = "loopwire_state_store_duration_seconds_count"
    assert delta(store, operation="accept") == 4  # three turns and the duplicate
    # the session history is read with the lease (one round trip), not separately
    assert delta(store, operation="load_messages") == 0
    assert delta(store, operation="save") >= 8
    assert delta(store, operation="lease") >= 4
    published = {kind: delta("loopwire_events_published_total", type=kind) for kind in EVENT_TYPES}
    await events.wait_for(lambda evs: len(evs) >= sum(published.values()))
    seen = {kind: sum(1 for e in events.events if e.type == kind) for kind in EVENT_TYPES}
    assert published == seen
    # two turns completed; the duplicate of a finished one announced its end again (the same
    # event, under the same id)
    assert published["turn.completed"] == 3 and published["turn.failed"] == 1
    completed_ids = [e.id for e in events.events if e.type == "turn.completed"]
    assert len(set(completed_ids)) == 2
    # build info
    build = {
        "version": package_version(),
        "component": "worker",
        "service": "worker",
    }
    infos = [dict(labels) for (name, labels) in w1 if name == "loopwire_build_info"]
    assert len(infos) == 1 and build.items() <= infos[0].items()
    # the tool service's own view
    ran = "loopwire_tool_service_call_duration_seconds_count"
    assert value(c1, ran, tool="calculate", outcome="ok") - value(c0, ran, tool="calculate") == 1
    assert value(c1, "loopwire_tool_service_calls_in_progress", tool="calculate") == 0
    assert value(c1, "loopwire_tool_service_calls_waiting") == 0
    infos = [dict(labels) for (name, labels) in c1 if name == "loopwire_build_info"]
    assert infos and infos[0]["service"] == "calculator"


# -- health ------------------------------------------------------------------------------------


@pytest.mark.integration
async def test_probes_answer_and_readyz_follows_redis(
    topology: None,
    spawn: Any,
    private_redis: tuple[str, tuple[Callable[[], None], ...]],
    tmp_path: Path,
) -> None:
    url, (start_redis, stop_redis) = private_redis
    worker = WorkerProcess(
        model_url="http://127.0.0.1:9/v1",
        agents_file=write_agents(tmp_path / "agents.json", []),
        redis_url=url,
        extra_env={"LOOPWIRE_REDIS_TIMEOUT_S": "1"},
    )
    tools_port = free_port()
    service = await spawn(
        "tool_services.calculator",
        tool="calculate",
        env={"LOOPWIRE_REDIS_URL": url, "LOOPWIRE_TOOLS__HTTP_PORT": str(tools_port)},
    )
    try:
        await worker.start()
        await eventually(lambda: answers(tools_port, "/readyz", 200, "ready"))
        for port in (worker.port, tools_port):
            assert await answers(port, "/livez", 200)
            assert await answers(port, "/readyz", 200, "ready")
        stop_redis()
        for port in (worker.port, tools_port):
            await eventually(functools.partial(answers, port, "/readyz", 503, "redis"))
            assert await answers(port, "/livez", 200)
        start_redis()
        for port in (worker.port, tools_port):
            await eventually(functools.partial(answers, port, "/readyz", 200, "ready"))
        service.signal(signal.SIGTERM)
        assert await service.wait() == 0
    finally:
        worker.close()
