"""Budgets over the sequencer and the memory store: each limit of each scope stops a model that
calls tools forever with one last model call without tools (or at once), and says why."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from contracts import tenancy
from contracts.messages import ChatMessage, ToolCall, Usage
from contracts.state import ModelResponse
from contracts.tools import ToolContext, ToolDefinition
from contracts.turns import Budget, InputMessage, TurnRequest, TurnResult
from worker.profiles.agents import AgentProfile
from worker.sequencing.actions import Reply, Step
from worker.sequencing.sequencer import SessionSequencer
from worker.testing.broker import ScriptedAnswers
from worker.testing.memory import FunctionTools, ListSink, MemoryStore
from worker.testing.sequencing import sequencer_over

SESSION = "s1"
LOOKUP = ToolDefinition(name="lookup", parameters={"type": "object"})
USAGE = Usage(prompt_tokens=8, completion_tokens=2, total_tokens=10)


async def lookup(args: dict[str, Any], ctx: ToolContext) -> Any:
    await asyncio.sleep(float(args.get("sleep", 0)))
    return {"items": ["something"]}


def calls_again(n: int, sleep: float = 0.0) -> ModelResponse:
    call = ToolCall(id=f"call_{n}", name="lookup", arguments=json.dumps({"sleep": sleep}))
    message = ChatMessage(role="assistant", content=f"searching {n}", tool_calls=(call,))
    return ModelResponse(message=message, finish_reason="tool_calls", usage=USAGE)


def answer(text: str = "What I have so far.") -> ModelResponse:
    return ModelResponse(message=ChatMessage(role="assistant", content=text), usage=USAGE)


class Rig:
    def __init__(
        self,
        profile: AgentProfile,
        *,
        price_per_call: float = 0.0,
        tenant_budgets: dict[str, Budget] | None = None,
    ) -> None:
        self.store = MemoryStore()
        self.model = ScriptedAnswers()
        self.tools = FunctionTools({"lookup": lookup})
        self.events = ListSink()
        self.sequencer: SessionSequencer = sequencer_over(
            self.store,
            model=self.model,
            tools=self.tools,
            definitions=[LOOKUP],
            events=self.events,
            agents=[profile],
            price=lambda _model, _usage: price_per_call,
            ledger=self.store,
            tenant_budget=(lambda t: (tenant_budgets or {}).get(t, Budget())),
        )

    async def run(self, turn_id: str = "t1", budget: Budget | None = None) -> TurnResult:
        request = TurnRequest(
            turn_id=turn_id,
            session_id=SESSION,
            agent="support",
            input=(InputMessage(content="find everything"),),
            reply_to="replies",
            budget=budget or Budget(),
        )
        actions: list[Any] = await self.sequencer.on_request(request)
        while True:
            replies = [a for a in actions if isinstance(a, Reply) and a.result.turn_id == turn_id]
            if replies:
                return replies[0].result
            [step] = [a for a in actions if isinstance(a, Step)]
            actions = await self.sequencer.on_step(step.work)

    def exhausted(self) -> list[Any]:
        return [e.data for e in self.events.events if e.type == "budget.exhausted"]


def forever(rig: Rig, calls: int, sleep: float = 0.0) -> None:
    rig.model.answers.extend(calls_again(n, sleep) for n in range(calls))
    rig.model.answers.append(answer())


@pytest.mark.parametrize(
    ("budget", "tool_steps", "name"),
    [
        (Budget(max_tool_calls=2), 2, "turn.max_tool_calls"),
        (Budget(max_total_tokens=25), 3, "turn.max_total_tokens"),
        (Budget(max_cost_usd=0.025), 3, "turn.max_cost_usd"),
    ],
)
async def test_a_spent_turn_budget_gets_one_last_answer_without_tools(
    budget: Budget, tool_steps: int, name: str
) -> None:
    rig = Rig(AgentProfile(name="support", budget=budget), price_per_call=0.01)
    forever(rig, tool_steps)

    result = await rig.run()

    assert (result.finish_reason, result.stopped_by) == ("budget", name)
    assert result.content == "What I have so far."
    assert len(rig.model.requests) == tool_steps + 1, "exactly one last call"
    assert len(rig.tools.calls) == tool_steps
    last = rig.model.requests[-1]
    assert list(last.tools) == [], "the last call is offered no tools"
    assert last.messages[-1].content is not None and "budget" in last.messages[-1].content
    assert result.cost_usd == pytest.approx(0.01 * (tool_steps + 1))
    steps = [e.data for e in rig.events.events if e.type == "step.completed"]
    assert [s.cost_usd for s in steps] == [0.01] * (tool_steps + 1), "each call's own cost"
    [spent] = rig.exhausted()
    assert (spent.budget, spent.final_call) == (name, True)
    rig.model.assert_done()


async def test_tool_calls_asked_for_in_the_last_call_are_not_run() -> None:
    rig = Rig(AgentProfile(name="support", budget=Budget(max_tool_calls=1)))
    rig.model.answers.extend([calls_again(0), calls_again(1)])

    result = await rig.run()

    assert (result.finish_reason, result.content) == ("budget", "searching 1")
    assert len(rig.tools.calls) == 1


async def test_wall_time_that_is_up_ends_the_turn_at_once() -> None:
    rig = Rig(AgentProfile(name="support", budget=Budget(max_wall_s=0.2)))
    rig.model.answers.append(calls_again(0, sleep=0.3))

    result = await rig.run()

    assert (result.finish_reason, result.stopped_by) == ("budget", "turn.max_wall_s")
    assert result.content == "searching 0"
    assert len(rig.model.requests) == 1, "no last call: the time is up"


async def test_a_request_lowers_the_turn_budget_but_never_raises_it() -> None:
    rig = Rig(AgentProfile(name="support", budget=Budget(max_tool_calls=3)))
    forever(rig, 1)
    lowered = await rig.run("t1", Budget(max_tool_calls=1))
    assert (lowered.stopped_by, len(rig.tools.calls)) == ("turn.max_tool_calls", 1)

    forever(rig, 3)
    raised = await rig.run("t2", Budget(max_tool_calls=10))
    assert raised.stopped_by == "turn.max_tool_calls"
    assert len(rig.tools.calls) == 1 + 3


async def test_a_session_budget_counts_the_session_s_earlier_turns() -> None:
    rig = Rig(AgentProfile(name="support", session_budget=Budget(max_tool_calls=3)))
    rig.model.answers.extend([calls_again(0), calls_again(1), answer("first")])
    first = await rig.run("t1")
    assert first.finish_reason == "stop"

    forever(rig, 1)
    second = await rig.run("t2")
    assert (second.finish_reason, second.stopped_by) == ("budget", "session.max_tool_calls")
    assert len(rig.tools.calls) == 3

    third = await rig.run("t3")  # spent before it called the model: ends at once
    assert (third.finish_reason, third.content, third.steps) == ("budget", None, 0)
    assert len(rig.model.requests) == 3 + 2
    rig.model.assert_done()


async def test_a_daily_budget_counts_every_session_of_the_agent() -> None:
    rig = Rig(AgentProfile(name="support", daily_budget=Budget(max_total_tokens=30)))
    rig.model.answers.extend([calls_again(0), calls_again(1), answer("first")])
    assert (await rig.run("t1")).finish_reason == "stop"
    assert (await rig.store.spent_today("support")).total_tokens == 30

    other = Rig(AgentProfile(name="support", daily_budget=Budget(max_total_tokens=30)))
    other.store.spend = rig.store.spend  # another session, the same day's ledger
    result = await other.run("t2")
    assert (result.finish_reason, result.stopped_by) == ("budget", "agent_day.max_total_tokens")
    assert other.model.requests == []


async def test_a_tenants_daily_budget_counts_its_turns_and_no_other_tenants() -> None:
    budgets = {"acme": Budget(max_total_tokens=30)}
    rig = Rig(AgentProfile(name="support"), tenant_budgets=budgets)
    rig.model.answers.extend([calls_again(0), calls_again(1), answer("first")])
    with tenancy.acting_for("acme"):
        assert (await rig.run("t1")).finish_reason == "stop"
    assert (await rig.store.spent_today("tenant:acme")).total_tokens == 30
    assert (await rig.store.spent_today("support")).total_tokens == 0  # no agent budget

    with tenancy.acting_for("acme"):  # spent: the next turn ends before it calls the model
        result = await rig.run("t2")
    assert (result.finish_reason, result.stopped_by) == ("budget", "tenant_day.max_total_tokens")
    assert [e.budget for e in rig.exhausted()] == ["tenant_day.max_total_tokens"]
    rig.model.answers.append(answer("globex's"))
    with tenancy.acting_for("globex"):  # another tenant, no budget: not held back
        assert (await rig.run("t3")).content == "globex's"
    assert (await rig.store.spent_today("tenant:globex")).total_tokens == 0
    rig.model.assert_done()


async def test_no_budget_configured_computes_nothing() -> None:
    rig = Rig(AgentProfile(name="support"))
    forever(rig, 3)
    result = await rig.run()
    assert result.finish_reason == "stop" and rig.exhausted() == []
    assert (await rig.store.spent_today("support")).total_tokens == 0


def test_budget_lowered_takes_the_lower_limit_of_each() -> None:
    mine = Budget(max_total_tokens=100, max_tool_calls=5)
    theirs = Budget(max_total_tokens=200, max_tool_calls=2, max_wall_s=9)
    assert mine.lowered(theirs) == Budget(max_total_tokens=100, max_tool_calls=2, max_wall_s=9)
