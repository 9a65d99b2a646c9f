"""Child turns and workflows over the ``SessionSequencer`` and a ``MemoryStore``
(``tests.unit.world``: the model answers by the agent that asks)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from contracts.control import TurnCancel, TurnChildResult, TurnDecision
from contracts.messages import ChatMessage
from contracts.state import ModelResponse, ToolExecution
from contracts.turns import TurnResult
from tests.unit.world import Answer, calls, last_user, request, says, tool_results, world
from worker.loop import Blocked, Hook, HookContext, ToolInvocation
from worker.loop.ports import ModelRequest
from worker.profiles.agents import AgentProfiles
from worker.redaction.config import RedactionConfig
from worker.redaction.service import Redaction
from worker.redaction.vault import MemoryVault
from worker.sequencing.actions import Action, Control, Delay, Drop, Start, Step

# -- agents as tools ----------------------------------------------------------------------------


def lead_answer(request: ModelRequest) -> ModelResponse:
    results = tool_results(request)
    if not results:
        return calls(("researcher", "find A"), ("writer", "draft B"))
    return says("combined: " + " | ".join(results))


TEAM = {
    "agents": [
        {"name": "lead", "agents": ["researcher", {"agent": "writer", "description": "Writes."}]},
        {"name": "researcher", "description": "Finds facts."},
        {"name": "writer"},
    ]
}
TEAM_ANSWERS: dict[str, Answer] = {
    "lead": lead_answer,
    "researcher": lambda r: says(f"facts on {last_user(r)}", tokens=5),
    "writer": lambda r: says(f"text for {last_user(r)}", tokens=7),
}


async def test_an_agent_calls_two_sub_agents_in_parallel() -> None:
    w = world(TEAM, TEAM_ANSWERS)
    await w.run(request("lead", "go"))
    result = w.result("T1")
    assert result.finish_reason == "stop"
    assert result.content == "combined: facts on find A | text for draft B"
    # the model saw both agents as tools, described by their profiles (or the caller's entry)
    offered = {d.name: d.description for d in w.model.asked("lead")[0].tools}
    assert offered == {"researcher": "Finds facts.", "writer": "Writes."}
    assert w.model.asked("lead")[0].tools[0].parameters["required"] == ["input"]
    # both children started in the same step, before either answered
    children = w.starts()
    assert [c.agent for c in children] == ["researcher", "writer"]
    assert {c.parent.turn_id for c in children if c.parent} == {"T1"}
    assert all(c.parent and c.parent.depth == 1 and c.parent.root_turn_id == "T1" for c in children)
    assert len({c.session_id for c in children}) == 2 and "S1" not in {
        c.session_id for c in children
    }
    # usage rolls up: the parent's two calls (10 each) and the children's (5 and 7)
    assert result.usage.total_tokens == 10 + 10 + 5 + 7
    # the child's result knows its parent; the child's events carry parent and root
    child = await w.child_result("T1", "call_0")
    assert child.parent is not None and child.parent.call_id == "call_0"
    child_events = [e for e in w.events.events if e.turn_id == child.turn_id]
    assert child_events and all(e.parent_turn_id == "T1" for e in child_events)
    assert all(e.root_turn_id == "T1" for e in child_events)
    assert all(e.headers()["ce-rootturnid"] == "T1" for e in child_events)
    parent_types = [e.type for e in w.events.events if e.turn_id == "T1"]
    assert parent_types.count("child.started") == 2 and parent_types.count("child.finished") == 2
    assert "tool.invoking" not in parent_types
    # only the parent's publisher gets a result (the children's go to the parent)
    assert {r.turn_id for r in w.replies} == {"T1"}


async def test_a_redone_parent_step_starts_no_second_child() -> None:
    w = world(TEAM, TEAM_ANSWERS)
    first = await w.sequencer.on_request(request("lead", "go"))
    assert isinstance(first[0], Step)
    parked = await w.sequencer.on_step(first[0].work)
    starts = [a for a in parked if isinstance(a, Start)]
    assert len(starts) == 2
    # the same step message again (its worker died before the ack): the same children again
    again = await w.sequencer.on_step(first[0].work)
    restarted = [a for a in again if isinstance(a, Start)]
    assert [a.request.turn_id for a in restarted] == [a.request.turn_id for a in starts]
    await w.drive([*parked, *again])
    assert w.result("T1").content == "combined: facts on find A | text for draft B"
    assert len(w.model.asked("researcher")) == 1 and len(w.model.asked("writer")) == 1
    # a child's result delivered twice is recorded once
    child = await w.child_result("T1", "call_0")
    assert child.parent is not None
    copy = await w.sequencer.on_child_result(TurnChildResult(parent=child.parent, result=child))
    assert [type(a) for a in copy] == [Drop]


class Guard(Hook):
    """Fills in a date in what a call is given, blocks calls to the writer, and shortens a
    word in what calls return."""

    async def before_tool(self, ctx: HookContext, call: ToolInvocation) -> ToolInvocation | Blocked:
        if call.name == "writer":
            return Blocked("no writing today")
        text = str(call.arguments.get("input", "")).replace("<TODAY>", "2026-12-04")
        return ToolInvocation(call.call_id, call.name, {"input": text})

    async def after_tool(self, ctx: HookContext, execution: ToolExecution) -> ToolExecution:
        return execution.model_copy(
            update={"content": execution.content.replace("2026-12-04", "today")}
        )


async def test_calls_to_sub_agents_pass_the_tool_hooks() -> None:
    answers: dict[str, Answer] = {
        "lead": lambda r: (
            calls(("researcher", "news of <TODAY>"), ("writer", "x"))
            if not tool_results(r)
            else says(" | ".join(tool_results(r)))
        ),
        "researcher": lambda r: says(f"found {last_user(r)}"),
    }
    w = world(TEAM, answers, hooks=Guard())
    await w.run(request("lead", "go"))
    # the child was given the arguments as the hook rewrote them; its answer went through the
    # hook's after_tool before the parent's model saw it
    assert w.model.asked("researcher")[0].messages[-1].content == "news of 2026-12-04"
    result = w.result("T1")
    assert result.content == 'found news of today | {"error": "blocked: no writing today"}'
    assert not w.model.asked("writer") and len(w.starts()) == 1


class RedactsLead(Hook):
    """The ``redact`` hook set, for the lead agent only: its sub-agents redact nothing."""

    def __init__(self) -> None:
        config = RedactionConfig(detect=("email",))
        self.redact = Redaction(MemoryVault(), default_ttl_s=3600).hooks(config)

    async def prepare_messages(
        self, ctx: HookContext, messages: list[ChatMessage]
    ) -> list[ChatMessage]:
        if ctx.agent.name != "lead":
            return messages
        return await self.redact.prepare_messages(ctx, messages)

    async def before_tool(self, ctx: HookContext, call: ToolInvocation) -> ToolInvocation | Blocked:
        if ctx.agent.name != "lead":
            return call
        return await self.redact.before_tool(ctx, call)

    async def after_tool(self, ctx: HookContext, execution: ToolExecution) -> ToolExecution:
        if ctx.agent.name != "lead":
            return execution
        return await self.redact.after_tool(ctx, execution)


async def test_a_child_of_a_redacting_agent_gets_placeholders_never_the_values() -> None:
    raw = "ann@example.com"
    answers: dict[str, Answer] = {
        "lead": lambda r: (
            calls(("researcher", last_user(r)))
            if not tool_results(r)
            else says(" | ".join(tool_results(r)))
        ),
        "researcher": lambda r: says(f"wrote to {last_user(r)}"),
    }
    w = world(TEAM, answers, hooks=RedactsLead())
    await w.run(request("lead", f"mail {raw} please"))
    [child] = w.starts()
    assert child.input[0].content == "mail «EMAIL_1» please"
    # neither model, nor the child's history, events or result ever held the value
    sent = [m for _, r in w.model.requests for m in r.messages]
    assert sent and all(raw not in m.model_dump_json() for m in sent)
    assert all(raw not in m.model_dump_json() for m in w.store.histories[child.session_id])
    assert all(raw not in e.model_dump_json() for e in w.events.events)
    assert raw not in (await w.child_result("T1", "call_0")).model_dump_json()
    assert w.result("T1").content == "wrote to mail «EMAIL_1» please"


def decide(call_id: str, verdict: str, **fields: Any) -> TurnDecision:
    return TurnDecision(
        turn_id="T1", session_id="S1", call_id=call_id, decision=verdict, by="maria", **fields
    )


async def test_decisions_on_sub_agent_calls_are_applied_before_a_child_starts() -> None:
    approving = {"agents": [{**TEAM["agents"][0], "approval": ["*"]}, *TEAM["agents"][1:]]}
    w = world(approving, TEAM_ANSWERS)
    await w.run(request("lead", "go"))
    assert not w.starts(), "the calls wait for their decisions"
    await w.drive(await w.sequencer.on_decision(decide("call_0", "reject", message="not now")))
    edited = decide("call_1", "edit", arguments={"input": "draft C"})
    await w.drive(await w.sequencer.on_decision(edited))
    # the rejected call started no child; the edited one ran with the edited input
    assert [c.agent for c in w.starts()] == ["writer"]
    assert not w.model.asked("researcher")
    assert last_user(w.model.asked("writer")[0]) == "draft C"
    result = w.result("T1")
    rejected = json.dumps({"error": "rejected by maria: not now"})
    assert result.content == f"combined: {rejected} | text for draft C"
    invoked = [e for e in w.events.events if e.type == "tool.invoked" and e.turn_id == "T1"]
    assert [(e.data.call_id, e.data.outcome) for e in invoked] == [("call_0", "blocked")]  # type: ignore[union-attr]


async def test_a_failing_child_comes_back_as_an_error() -> None:
    def boom(_: ModelRequest) -> ModelResponse:
        return calls(("writer", "x"))  # calls what it may not: at its iteration cap…

    profiles = {
        "agents": [
            {"name": "lead", "agents": ["researcher"]},
            {"name": "researcher", "limits": {"max_tool_iterations": 1}},
            {"name": "writer"},
        ]
    }
    answers: dict[str, Answer] = {
        "lead": lambda r: (
            calls(("researcher", "q")) if not tool_results(r) else says("saw " + tool_results(r)[0])
        ),
        "researcher": boom,
    }
    w = world(profiles, answers)
    await w.run(request("lead", "go"))
    result = w.result("T1")
    assert result.finish_reason == "stop"
    seen = json.loads(result.content.removeprefix("saw ") if result.content else "{}")
    assert "iteration cap" in seen["error"]


async def test_calls_deeper_than_max_depth_come_back_as_errors() -> None:
    def recurse(request: ModelRequest) -> ModelResponse:
        results = tool_results(request)
        if not results:
            return calls(("echo", "deeper"))
        return says("got " + results[0])

    profiles = {"agents": [{"name": "echo", "agents": ["echo"], "max_depth": 2}]}
    w = world(profiles, {"echo": recurse})
    await w.run(request("echo", "top"))
    result = w.result("T1")
    # depth 1 and 2 ran; the call from depth 2 was refused
    assert len(w.starts()) == 2
    assert "max_depth" in (result.content or "")
    assert result.content is not None and result.content.startswith("got got ")


async def test_cancelling_a_parent_cancels_its_running_children() -> None:
    w = world(TEAM, TEAM_ANSWERS)
    first = await w.sequencer.on_request(request("lead", "go"))
    parked = await w.sequencer.on_step(first[0].work)  # type: ignore[union-attr]
    starts = [a for a in parked if isinstance(a, Start)]
    queued: list[Action] = []
    for start in starts:  # the children are accepted, their first steps still queued
        queued += await w.sequencer.on_request(start.request)
    cancelled = await w.sequencer.on_cancel(TurnCancel(turn_id="T1", session_id="S1"))
    await w.drive(cancelled)
    await w.drive(queued)
    assert w.result("T1").finish_reason == "cancelled"
    cancels = [
        a.message
        for a in w.published
        if isinstance(a, Control) and isinstance(a.message, TurnCancel)
    ]
    assert {c.turn_id for c in cancels} == {s.request.turn_id for s in starts}
    for start in starts:
        child = await w.store.result(start.request.session_id, start.request.turn_id)
        assert child is not None and child.finish_reason == "cancelled"
        assert child.stopped_by == "parent cancelled"
    assert not w.model.asked("researcher") and not w.model.asked("writer")


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


async def test_a_child_that_does_not_answer_in_time_ends_as_an_error_and_is_cancelled() -> None:
    bounded = {"agents": [{**TEAM["agents"][0], "children_timeout_s": 60}, *TEAM["agents"][1:]]}
    clock = Clock()
    w = world(bounded, TEAM_ANSWERS, clock=clock)
    first = await w.sequencer.on_request(request("lead", "go"))
    parked = await w.sequencer.on_step(first[0].work)  # type: ignore[union-attr]
    researcher, writer = [a for a in parked if isinstance(a, Start)]
    # the turn has no deadline, yet its wait for the children is bounded
    [delay] = [a for a in parked if isinstance(a, Delay)]
    assert delay.work.wait_until == clock.now + 60
    await w.drive([researcher])  # the researcher answers; the writer's request is lost
    clock.now += 59
    assert await w.sequencer.on_step(delay.work) == [Delay(delay.work)]  # not due yet
    clock.now += 1
    await w.drive([Step(delay.work)])
    missing = json.dumps({"error": "sub-agent writer failed: child_timeout: no answer within 60s"})
    assert w.result("T1").content == f"combined: facts on find A | {missing}"
    cancels = [
        a.message
        for a in w.published
        if isinstance(a, Control) and isinstance(a.message, TurnCancel)
    ]
    assert [c.turn_id for c in cancels] == [writer.request.turn_id]
    # the writer's answer, should it come after all, changes nothing
    late = TurnResult(
        turn_id=writer.request.turn_id,
        session_id=writer.request.session_id,
        agent="writer",
        content="too late",
        finish_reason="stop",
        steps=1,
        duration_s=61,
        completed_at=clock.now,
        parent=writer.request.parent,
    )
    assert writer.request.parent is not None
    again = await w.sequencer.on_child_result(
        TurnChildResult(parent=writer.request.parent, result=late)
    )
    assert [type(a) for a in again] == [Drop]
    assert len([r for r in w.replies if r.turn_id == "T1"]) == 1


async def test_a_child_that_arrives_after_its_parent_stopped_waiting_runs_nothing() -> None:
    bounded = {"agents": [{**TEAM["agents"][0], "children_timeout_s": 60}, *TEAM["agents"][1:]]}
    clock = Clock()
    w = world(bounded, TEAM_ANSWERS, clock=clock)
    first = await w.sequencer.on_request(request("lead", "go"))
    parked = await w.sequencer.on_step(first[0].work)  # type: ignore[union-attr]
    researcher, writer = [a for a in parked if isinstance(a, Start)]
    [delay] = [a for a in parked if isinstance(a, Delay)]
    # a child's deadline is the end of its parent's wait for it
    assert writer.request.deadline == delay.work.wait_until
    await w.drive([researcher])
    clock.now += 61
    gave_up = await w.sequencer.on_step(delay.work)
    # the writer's request arrives only now, before the cancel the parent sent it
    await w.drive([writer])
    ended = await w.store.result(writer.request.session_id, writer.request.turn_id)
    assert ended is not None and ended.stopped_by == "deadline"
    assert not w.model.asked("writer")
    await w.drive(gave_up)
    assert w.result("T1").content is not None and "child_timeout" in w.result("T1").content


async def test_a_child_whose_parent_ended_before_it_was_accepted_does_not_run() -> None:
    w = world(TEAM, TEAM_ANSWERS)
    first = await w.sequencer.on_request(request("lead", "go"))
    parked = await w.sequencer.on_step(first[0].work)  # type: ignore[union-attr]
    starts = [a for a in parked if isinstance(a, Start)]
    # the parent is cancelled while its children's requests are still on their way: the
    # cancels find no such turn yet
    await w.drive(await w.sequencer.on_cancel(TurnCancel(turn_id="T1", session_id="S1")))
    assert w.result("T1").finish_reason == "cancelled"
    await w.drive(list(starts))
    for start in starts:
        child = await w.store.result(start.request.session_id, start.request.turn_id)
        assert child is not None and child.finish_reason == "cancelled"
        assert child.stopped_by == "parent cancelled"
    assert not w.model.asked("researcher") and not w.model.asked("writer")


async def test_children_spend_the_parents_budget() -> None:
    profiles = {
        "agents": [
            {"name": "lead", "agents": ["researcher"], "budget": {"max_total_tokens": 100}},
            {"name": "researcher"},
        ]
    }
    answers: dict[str, Answer] = {
        "lead": lambda r: calls(("researcher", "more"), tokens=10),
        "researcher": lambda r: says("lots", tokens=40),
    }
    w = world(profiles, answers)
    w.model.answers["lead"] = lambda r: (
        says("final", tokens=10) if not r.tools else calls(("researcher", "more"), tokens=10)
    )
    await w.run(request("lead", "go"))
    result = w.result("T1")
    assert result.finish_reason == "budget"
    assert result.stopped_by == "turn.max_total_tokens"
    budgets = [c.budget.max_total_tokens for c in w.starts()]
    assert budgets[0] == 90  # what was left after the parent's first call
    assert budgets == sorted(budgets, reverse=True)


async def test_a_recursive_tree_counts_each_model_call_once_in_its_agents_day() -> None:
    def recurse(request: ModelRequest) -> ModelResponse:
        results = tool_results(request)
        return calls(("echo", "deeper")) if not results else says("got " + results[0])

    daily = {"max_total_tokens": 45}
    profiles = {
        "agents": [{"name": "echo", "agents": ["echo"], "max_depth": 1, "daily_budget": daily}]
    }
    w = world(profiles, {"echo": recurse}, daily=True)
    await w.run(request("echo", "top"))
    # two calls each for the parent and its child (10 tokens a call): 40 in all, so the
    # parent's last call (30 spent before it) is within the day's 45
    assert len(w.model.requests) == 4
    assert w.result("T1").finish_reason == "stop"
    assert w.result("T1").usage.total_tokens == 40, "the parent's result still rolls up"
    assert w.store.spend["echo"].total_tokens == 40


# -- workflows ----------------------------------------------------------------------------------

CLASSIFY = {
    "name": "classifier",
    "output_schema": {
        "type": "object",
        "properties": {"category": {"type": "string", "enum": ["billing", "technical"]}},
        "required": ["category"],
    },
}


def flows(*workflows: dict[str, Any], agents: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    base = [{"name": n} for n in ("a", "b", "c", "judge")]
    return {"agents": [*base, CLASSIFY, *agents], "workflows": list(workflows)}


ECHOES: dict[str, Answer] = {
    name: (lambda n: lambda r: says(f"{n}({last_user(r)})"))(name) for name in ("a", "b", "c")
}


async def test_a_sequential_workflow_feeds_each_answer_to_the_next() -> None:
    spec = flows(
        {
            "name": "chain",
            "kind": "sequential",
            "nodes": [
                {"run": "a"},
                {"run": "b"},
                {"run": "c", "input": "{input} / {a}"},
            ],
        }
    )
    w = world(spec, ECHOES)
    await w.run(request("chain", "x"))
    result = w.result("T1")
    assert result.content == "c(x / a(x))"
    assert [m[1].messages[-1].content for m in w.model.requests] == ["x", "a(x)", "x / a(x)"]
    assert result.steps == 3
    # the workflow ran no model of its own, and its session holds the question and the answer
    assert {a for a, _ in w.model.requests} == {"a", "b", "c"}
    history = w.store.histories.get("S1", [])
    assert [(m.role, m.content) for m in history] == [("user", "x"), ("assistant", "c(x / a(x))")]


async def test_a_parallel_workflow_fans_out_and_joins() -> None:
    plain = flows({"name": "fan", "kind": "parallel", "nodes": [{"run": "a"}, {"run": "b"}]})
    w = world(plain, ECHOES)
    await w.run(request("fan", "x"))
    result = w.result("T1")
    assert result.content == "[a]\na(x)\n\n[b]\nb(x)"
    assert result.output == {"a": "a(x)", "b": "b(x)"}

    joined = flows(
        {
            "name": "fan",
            "kind": "parallel",
            "nodes": [{"run": "a"}, {"run": "b"}],
            "join": {"run": "c"},
        }
    )
    w = world(joined, ECHOES)
    await w.run(request("fan", "x"))
    assert w.result("T1").content == "c([a]\na(x)\n\n[b]\nb(x))"


async def test_a_workflow_node_that_does_not_answer_in_time_fails_the_workflow() -> None:
    fan = {"name": "fan", "kind": "parallel", "nodes": [{"run": "a"}, {"run": "b"}]}
    clock = Clock()
    w = world(flows({**fan, "children_timeout_s": 30}), ECHOES, clock=clock)
    first = await w.sequencer.on_request(request("fan", "x"))
    parked = await w.sequencer.on_step(first[0].work)  # type: ignore[union-attr]
    a, _ = [x for x in parked if isinstance(x, Start)]
    [delay] = [x for x in parked if isinstance(x, Delay)]
    await w.drive([a])  # node b's request is lost
    clock.now += 30
    await w.drive([Step(delay.work)])
    result = w.result("T1")
    assert result.error is not None and result.error.code == "node_failed"
    assert "child_timeout: no answer within 30s" in result.error.message


def classifier(category: str | None) -> Answer:
    return lambda r: says(json.dumps({"category": category} if category else {"other": 1}))


async def test_a_conditional_workflow_routes_on_a_field_of_the_output() -> None:
    spec = flows(
        {
            "name": "triage",
            "kind": "conditional",
            "node": {"run": "classifier"},
            "on": "category",
            "routes": {"billing": {"run": "a"}, "technical": {"run": "b"}},
            "default": {"run": "c"},
        }
    )
    w = world(spec, {**ECHOES, "classifier": classifier("technical")})
    await w.run(request("triage", "my printer"))
    assert w.result("T1").content == "b(my printer)"
    assert not w.model.asked("a")


async def test_a_loop_workflow_repeats_until_its_condition_holds() -> None:
    judge = {
        "name": "judge",
        "output_schema": {
            "type": "object",
            "properties": {"done": {"type": "boolean"}, "text": {"type": "string"}},
        },
    }
    spec = {
        "agents": [judge],
        "workflows": [
            {
                "name": "refine",
                "kind": "loop",
                "node": {"run": "judge"},
                "until": {"field": "done", "equals": True},
                "max_rounds": 5,
            }
        ],
    }
    rounds = iter([False, False, True])
    answers: dict[str, Answer] = {
        "judge": lambda r: says(json.dumps({"done": next(rounds), "text": last_user(r) + "+"}))
    }
    w = world(spec, answers)
    await w.run(request("refine", "draft"))
    result = w.result("T1")
    assert result.steps == 3
    assert result.output["done"] is True
    assert len(w.model.asked("judge")) == 3

    capped = {**spec, "workflows": [{**spec["workflows"][0], "max_rounds": 2}]}
    w = world(capped, {"judge": lambda r: says(json.dumps({"done": False}))})
    await w.run(request("refine", "draft"))
    assert w.result("T1").steps == 2


async def test_a_failing_node_fails_the_workflow() -> None:
    spec = flows(
        {"name": "chain", "kind": "sequential", "nodes": [{"run": "classifier"}, {"run": "a"}]}
    )
    w = world(spec, {**ECHOES, "classifier": lambda r: says("not json")})
    await w.run(request("chain", "x"))
    result = w.result("T1")
    assert result.finish_reason == "error"
    assert result.error is not None and result.error.code == "node_failed"
    assert "classifier" in result.error.message
    assert not w.model.asked("a")


@pytest.mark.parametrize(
    ("workflow", "message"),
    [
        (
            {"name": "w", "kind": "sequential", "nodes": [{"run": "nobody"}]},
            "'nobody', which is neither",
        ),
        (
            {
                "name": "w",
                "kind": "conditional",
                "node": {"run": "classifier"},
                "on": "mood",
                "routes": {"x": {"run": "a"}},
            },
            "no such property",
        ),
        (
            {
                "name": "w",
                "kind": "conditional",
                "node": {"run": "a"},
                "on": "category",
                "routes": {"x": {"run": "b"}},
            },
            "not an agent with an output_schema",
        ),
        (
            {
                "name": "w",
                "kind": "conditional",
                "node": {"run": "classifier"},
                "on": "category",
                "routes": {"sales": {"run": "b"}},
            },
            "route 'sales' is not a value",
        ),
        ({"name": "w", "kind": "loop", "node": {"run": "w"}}, "contain each other: w -> w"),
        ({"name": "w", "kind": "sequential", "nodes": [{"run": "a", "input": "{b}"}]}, "{b}"),
        (
            {"name": "w", "kind": "parallel", "nodes": [{"run": "a"}, {"run": "a"}]},
            "ids must differ",
        ),
        (
            {"name": "a", "kind": "sequential", "nodes": [{"run": "b"}]},
            "both an agent and a workflow",
        ),
    ],
)
def test_a_bad_workflow_is_refused_when_the_file_loads(
    workflow: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("{", r"\{")):
        AgentProfiles.model_validate(flows(workflow))


def test_an_unknown_sub_agent_is_refused_when_the_file_loads() -> None:
    with pytest.raises(ValueError, match="calls 'ghost', which is not defined"):
        AgentProfiles.model_validate({"agents": [{"name": "lead", "agents": ["ghost"]}]})


def test_cycles_through_other_workflows_are_found() -> None:
    a = {"name": "w1", "kind": "sequential", "nodes": [{"run": "w2"}]}
    b = {"name": "w2", "kind": "sequential", "nodes": [{"run": "a"}, {"run": "w1"}]}
    with pytest.raises(ValueError, match="w1 -> w2 -> w1"):
        AgentProfiles.model_validate(flows(a, b))


async def test_a_child_queued_in_a_named_session_and_cancelled_there_reports_to_its_parent() -> (
    None
):
    """A sub-agent whose calls share one named session: a child queued there behind another
    turn and cancelled before it starts still ends its parent's wait, with a cancelled result."""
    team = {
        "agents": [
            {"name": "lead", "agents": [{"agent": "helper", "session": "shared"}]},
            {"name": "helper"},
        ]
    }
    answers: dict[str, Answer] = {
        "lead": lambda r: calls(("helper", "go")) if not tool_results(r) else says("done"),
        "helper": lambda r: says("helped"),
    }
    w = world(team, answers)
    # a turn of the named session's own runs (and holds its queue) when the child arrives
    busy = request("helper", "first", turn_id="H1").model_copy(update={"session_id": "shared"})
    await w.sequencer.on_request(busy)
    [kick] = await w.sequencer.on_request(request("lead", "go"))
    assert isinstance(kick, Step)
    parked = await w.sequencer.on_step(kick.work)
    [child] = [a.request for a in parked if isinstance(a, Start)]
    assert await w.sequencer.on_request(child) == []  # queued behind H1
    assert (await w.store.head("shared")) == "H1"  # the child waits behind it
    assert child.turn_id in w.store.queues["shared"]

    await w.drive([Control(TurnCancel(turn_id=child.turn_id, session_id="shared", reason="user"))])

    result = w.result("T1")
    assert result.finish_reason == "stop" and result.content == "done"
    [tool] = [m for _, r in w.model.requests for m in r.messages if m.role == "tool"]
    assert "cancelled" in (tool.content or "")
