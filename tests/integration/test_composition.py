"""Agents that call agents, and workflows, over the real broker and Redis: sub-agents in
parallel, each workflow kind, workers killed while a parent waits and while a child runs, a
cancelled parent, budgets rolled up, the depth limit and structured output that stays invalid.

The scripted model answers by the agent asking (its system prompt is ``agent:<name>``)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from contracts import keys
from contracts.client import LoopwireClient, new_id
from harness import CountingToolService, EventRecorder, WorkerProcess, run_past_a_crash
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration

Answer = Callable[[dict[str, Any]], Reply]


def last_user(body: dict[str, Any]) -> str:
    return next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")


def tool_results(body: dict[str, Any]) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "tool"]


class ByAgent:
    """Answers each model call by the agent that makes it; counts the calls of each."""

    def __init__(self, answers: dict[str, Answer]) -> None:
        self.answers = answers
        self.calls: Counter[str] = Counter()

    def __call__(self, body: dict[str, Any]) -> Reply:
        agent = body["messages"][0]["content"].removeprefix("agent:")
        self.calls[agent] += 1
        return self.answers[agent](body)


def agents_file(tmp_path: Path, agents: list[dict[str, Any]], **rest: Any) -> Path:
    for agent in agents:
        agent.setdefault("system_prompt", f"agent:{agent['name']}")
        agent.setdefault("tools", [])
    path = tmp_path / "agents.json"
    path.write_text(json.dumps({"agents": agents, **rest}))
    return path


def worker(model: ScriptedModel, agents: Path, **env: str) -> WorkerProcess:
    return WorkerProcess(model_url=model.base_url, agents_file=agents, extra_env=env)


def lead(body: dict[str, Any]) -> Reply:
    results = tool_results(body)
    if not results:
        return Reply.tool_calls(("researcher", {"input": "find A"}), ("writer", {"input": "B"}))
    return Reply.text("combined: " + " | ".join(results))


TEAM = [
    {"name": "lead", "agents": ["researcher", "writer"]},
    {"name": "researcher", "description": "Finds facts."},
    {"name": "writer", "description": "Writes."},
]


async def test_an_agent_calls_two_sub_agents_in_parallel_and_a_subscriber_follows_the_tree(
    scripted_model: ScriptedModel, client: LoopwireClient, events: EventRecorder, tmp_path: Path
) -> None:
    def researcher(body: dict[str, Any]) -> Reply:
        return Reply.text(f"facts on {last_user(body)}", delay=1.0)

    model = ByAgent(
        {"lead": lead, "researcher": researcher, "writer": lambda b: Reply.text("text", delay=1.0)}
    )
    scripted_model.respond_with(model)
    async with worker(scripted_model, agents_file(tmp_path, TEAM)) as w:
        handle = await client.start_turn("lead", "go")
        tree: list[Any] = []

        async def follow() -> None:
            async for event in client.tree(handle.turn_id):
                tree.append(event)
                if event.type == "turn.completed" and event.turn_id == handle.turn_id:
                    return

        follower = asyncio.create_task(follow())
        started = asyncio.get_running_loop().time()
        result = await handle.result(30)
        took = asyncio.get_running_loop().time() - started
        await asyncio.wait_for(follower, 10)
        await handle.close()
    assert w.errors() == []
    assert result.content == "combined: facts on find A | text"
    assert took < 1.9, "the two children ran one after the other"
    assert model.calls == {"lead": 2, "researcher": 1, "writer": 1}
    offered = {
        t["function"]["name"]: t["function"]["description"]
        for t in scripted_model.requests[0]["tools"]
    }
    assert offered == {"researcher": "Finds facts.", "writer": "Writes."}
    children = {e.turn_id for e in tree if e.parent_turn_id == handle.turn_id}
    assert len(children) == 2
    parent_types = [e.type for e in tree if e.turn_id == handle.turn_id]
    assert parent_types.count("child.started") == 2 and parent_types.count("child.finished") == 2
    assert all(
        any(e.type == "turn.completed" and e.turn_id == child for e in tree) for child in children
    )


@pytest.mark.parametrize("point", ["parked", "child_result_recorded"])
async def test_a_worker_killed_while_the_parent_waits_runs_nothing_twice(
    point: str,
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    lookup: CountingToolService,
    tmp_path: Path,
) -> None:
    def researcher(body: dict[str, Any]) -> Reply:
        if not tool_results(body):
            return Reply.tool_calls((lookup.name, {"q": last_user(body)}))
        return Reply.text("researched " + tool_results(body)[0])

    model = ByAgent({"lead": lead, "researcher": researcher, "writer": lambda b: Reply.text("w")})
    scripted_model.respond_with(model)
    team = [{**TEAM[0]}, {**TEAM[1], "tools": [lookup.name]}, {**TEAM[2]}]
    agents = agents_file(tmp_path, team)
    result, survivor = await run_past_a_crash(
        client, scripted_model.base_url, agents, point, "lead", "go"
    )
    assert survivor.errors() == []
    assert result.content is not None and result.content.startswith("combined: researched ")
    assert model.calls == {"lead": 2, "researcher": 2, "writer": 1}, "a finished call ran again"
    assert sum(lookup.executions.values()) == 1, "the child's tool ran twice"


async def test_a_worker_killed_while_a_child_runs_resumes_the_child(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    lookup: CountingToolService,
    tmp_path: Path,
) -> None:
    def researcher(body: dict[str, Any]) -> Reply:
        if not tool_results(body):
            return Reply.tool_calls((lookup.name, {"q": "x"}))
        return Reply.text("researched", delay=3.0)  # the worker dies while it waits for this

    model = ByAgent({"lead": lead, "researcher": researcher, "writer": lambda b: Reply.text("w")})
    scripted_model.respond_with(model)
    team = [{**TEAM[0]}, {**TEAM[1], "tools": [lookup.name]}, {**TEAM[2]}]
    agents = agents_file(tmp_path, team)
    first = worker(scripted_model, agents)
    second = worker(scripted_model, agents)
    await first.start()
    try:
        handle = await client.start_turn("lead", "go")
        for _ in range(400):
            if model.calls["researcher"] == 2:
                break
            await asyncio.sleep(0.05)
        assert model.calls["researcher"] == 2
        first.kill()
        await second.start()
        result = await handle.result(40)
        await handle.close()
    finally:
        first.close()
        second.close()
    assert second.errors() == []
    assert result.content == "combined: researched | w"
    assert sum(lookup.executions.values()) == 1, "the child's saved tool result was not reused"
    assert model.calls["lead"] == 2 and model.calls["writer"] == 1
    assert model.calls["researcher"] == 3  # only the call the worker died in was asked again


async def test_cancelling_a_parent_cancels_its_running_children(
    scripted_model: ScriptedModel, client: LoopwireClient, events: EventRecorder, tmp_path: Path
) -> None:
    model = ByAgent(
        {
            "lead": lead,
            "researcher": lambda b: Reply.text("late", delay=30.0),
            "writer": lambda b: Reply.text("late", delay=30.0),
        }
    )
    scripted_model.respond_with(model)
    async with worker(scripted_model, agents_file(tmp_path, TEAM)) as w:
        handle = await client.start_turn("lead", "go")
        await events.wait_for(
            lambda evs: sum(e.type == "turn.started" and bool(e.parent_turn_id) for e in evs) == 2,
            20,
        )
        await scripted_model.wait_for_requests(3, timeout=20)
        await handle.cancel("user left", by="test")
        result = await handle.result(20)
        await handle.close()
        await events.wait_for(
            lambda evs: (
                sum(e.type == "turn.cancelled" and bool(e.parent_turn_id) for e in evs) == 2
            ),
            20,
        )
    assert w.errors() == []
    assert (result.finish_reason, result.stopped_by) == ("cancelled", "user left")
    child_ends = [e for e in events.events if e.type == "turn.cancelled" and e.parent_turn_id]
    assert {e.data.result.stopped_by for e in child_ends} == {"parent cancelled"}  # type: ignore[union-attr]
    assert all(e.data.result.duration_s < 15 for e in child_ends)  # type: ignore[union-attr]


async def test_a_child_that_does_not_answer_in_time_is_an_error_for_its_parent_and_ends(
    scripted_model: ScriptedModel, client: LoopwireClient, events: EventRecorder, tmp_path: Path
) -> None:
    model = ByAgent(
        {
            "lead": lead,
            "researcher": lambda b: Reply.text("facts"),
            "writer": lambda b: Reply.text("late", delay=30.0),
        }
    )
    scripted_model.respond_with(model)
    team = [{**TEAM[0], "children_timeout_s": 2}, *TEAM[1:]]
    async with worker(scripted_model, agents_file(tmp_path, team)) as w:
        result = await client.run_turn("lead", "go", timeout=20)
        await events.wait_for(
            lambda evs: any(e.type == "turn.cancelled" and e.agent == "writer" for e in evs), 20
        )
    assert w.errors() == []
    assert result.finish_reason == "stop"
    assert result.content is not None and result.content.startswith("combined: facts | ")
    # whichever comes first: the parent's wait ends, or the child's deadline (the same time)
    writer = json.loads(result.content.removeprefix("combined: facts | "))["error"]
    assert writer in (
        "sub-agent writer failed: child_timeout: no answer within 2s",
        "sub-agent writer was cancelled (deadline)",
    )
    assert result.duration_s < 10
    [ended] = [e for e in events.events if e.type == "turn.cancelled" and e.agent == "writer"]
    assert ended.data.result.duration_s < 10  # type: ignore[union-attr]


async def test_budgets_roll_up_and_the_depth_limit_answers_the_model(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    def nested(body: dict[str, Any]) -> Reply:
        results = tool_results(body)
        if not results:
            return Reply.tool_calls(("nested", {"input": "deeper"}))
        return Reply.text("got " + results[0])

    model = ByAgent(
        {
            "nested": nested,
            "spender": lambda b: Reply.tool_calls(("helper", {"input": "more"})),
            "helper": lambda b: Reply.text("lots", usage=(400, 100)),
        }
    )
    scripted_model.respond_with(model)
    agents = agents_file(
        tmp_path,
        [
            {"name": "nested", "agents": ["nested"], "max_depth": 1},
            {"name": "spender", "agents": ["helper"], "budget": {"max_total_tokens": 800}},
            {"name": "helper"},
        ],
    )
    async with worker(scripted_model, agents) as w:
        deep = await client.run_turn("nested", "top", timeout=30)
        spent = await client.run_turn("spender", "go", timeout=40)
    assert w.errors() == []
    # the root's child ran (depth 1); the child's own call was refused
    assert model.calls["nested"] == 4
    assert deep.content is not None and "max_depth" in deep.content
    # each round: the spender's call and the helper's 500 tokens, until the budget is spent
    assert (spent.finish_reason, spent.stopped_by) == ("budget", "turn.max_total_tokens")
    # (without the roll-up the spender's own calls would never reach 800 tokens)
    assert model.calls["helper"] >= 1
    assert spent.usage.total_tokens >= 500 * model.calls["helper"]


async def test_structured_output_that_stays_invalid_fails_the_turn(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    agents = agents_file(
        tmp_path, [{"name": "counter", "output_schema": schema, "max_output_repairs": 1}]
    )
    scripted_model.respond_with(lambda body: Reply.text('{"n": "two"}'))
    async with worker(scripted_model, agents) as w:
        result = await client.run_turn("counter", "count", timeout=30)
    assert w.errors() == []
    assert result.finish_reason == "error" and result.error is not None
    assert result.error.code == "invalid_output"
    assert result.content == '{"n": "two"}' and result.steps == 2


# -- workflows ----------------------------------------------------------------------------------

CLASSIFIER = {
    "name": "classifier",
    "output_schema": {
        "type": "object",
        "properties": {
            "category": {"type": "string", "enum": ["billing", "technical"]},
            "done": {"type": "boolean"},
        },
        "required": ["category"],
    },
}
WORKFLOWS = [
    {
        "name": "chain",
        "kind": "sequential",
        "nodes": [{"run": "a"}, {"run": "b", "input": "{input}+{a}"}],
    },
    {
        "name": "fan",
        "kind": "parallel",
        "nodes": [{"run": "a"}, {"run": "b"}],
        "join": {"run": "c"},
    },
    {
        "name": "route",
        "kind": "conditional",
        "node": {"run": "classifier"},
        "on": "category",
        "routes": {"billing": {"run": "a"}, "technical": {"run": "b"}},
    },
    {
        "name": "again",
        "kind": "loop",
        "node": {"run": "classifier"},
        "until": {"field": "done", "equals": True},
        "max_rounds": 4,
    },
]


def echo(name: str) -> Answer:
    return lambda body: Reply.text(f"{name}({last_user(body)})")


async def test_each_workflow_kind_over_the_real_broker(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    rounds = Counter[str]()

    def classify(body: dict[str, Any]) -> Reply:
        rounds["classifier"] += 1
        done = rounds["classifier"] >= 3
        return Reply.text(json.dumps({"category": "technical", "done": done}))

    model = ByAgent({"a": echo("a"), "b": echo("b"), "c": echo("c"), "classifier": classify})
    scripted_model.respond_with(model)
    agents = agents_file(
        tmp_path, [{"name": "a"}, {"name": "b"}, {"name": "c"}, {**CLASSIFIER}], workflows=WORKFLOWS
    )
    async with worker(scripted_model, agents) as w:
        chain = await client.run_turn("chain", "x", timeout=30)
        fan = await client.run_turn("fan", "x", timeout=30)
        route = await client.run_turn("route", "printer", timeout=30)
        rounds.clear()
        again = await client.run_turn("again", "start", timeout=30)
    assert w.errors() == []
    assert chain.content == "b(x+a(x))"
    assert fan.content == "c([a]\na(x)\n\n[b]\nb(x))"
    assert route.content == "b(printer)"
    assert (again.steps, again.output) == (3, {"category": "technical", "done": True})


async def test_a_workflow_resumes_after_its_worker_dies_without_rerunning_a_node(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    model = ByAgent({"a": echo("a"), "b": echo("b"), "c": echo("c")})
    scripted_model.respond_with(model)
    agents = agents_file(
        tmp_path,
        [{"name": "a"}, {"name": "b"}, {"name": "c"}],
        workflows=[
            {
                "name": "chain",
                "kind": "sequential",
                "nodes": [{"run": "a"}, {"run": "b"}, {"run": "c"}],
            }
        ],
    )
    result, survivor = await run_past_a_crash(
        client, scripted_model.base_url, agents, "child_result_recorded", "chain", "x"
    )
    assert survivor.errors() == []
    assert result.content == "c(b(a(x)))"
    assert model.calls == {"a": 1, "b": 1, "c": 1}


async def test_deleting_a_parent_session_deletes_its_child_sessions(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    events: EventRecorder,
    redis: Redis,
    tmp_path: Path,
) -> None:
    def answer(body: dict[str, Any]) -> Reply:
        return Reply.text(f"re: {last_user(body)}")

    scripted_model.respond_with(ByAgent({"lead": lead, "researcher": answer, "writer": answer}))
    session = new_id()
    async with worker(scripted_model, agents_file(tmp_path, TEAM)) as w:
        result = await client.run_turn("lead", "my card is 4111", session_id=session, timeout=30)
        children = {
            e.data.session_id  # type: ignore[union-attr]
            for e in events.events
            if e.type == "child.started" and e.turn_id == result.turn_id
        }
        assert len(children) == 2 and all([await client.sessions.get(c) for c in children])

        assert await client.sessions.delete(session, by="test") > 0
        await events.wait_for(
            lambda evs: (
                {e.session_id for e in evs if e.type == "session.deleted"} >= {session, *children}
            )
        )
    assert w.errors() == []
    for gone in (session, *children):  # all but the fence, kept so tokens never go back
        left = [k async for k in redis.scan_iter(match=f"*{{{gone}}}*")]
        assert [k for k in left if k != keys.session_fence(gone).encode()] == [], gone
