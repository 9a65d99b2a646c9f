"""Profiles a platform runs: the prompt follows the turn's agent, prompt versions are recorded,
hooks can stop and continue a turn (the priority chain), the built-in guards, and the model
router's fallback chain. Over the sequencer and a ``MemoryStore`` (``tests.unit.world``)."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

from contracts.messages import ChatMessage
from contracts.state import AgentStep, ModelResponse
from contracts.tools import ToolContext
from tests.unit.world import calls, last_user, request, says, tool_results, world
from worker.errors import ModelError
from worker.loop import Hook, HookContext
from worker.loop.hooks import Hooks
from worker.loop.ports import ModelRequest
from worker.model.router import ModelRouter
from worker.profiles.agents import AgentProfiles
from worker.profiles.guards import ContentGuard, ContentGuardConfig, ToolGuard, ToolGuardConfig
from worker.profiles.hooksets import HookSets


def calls_tool(name: str, **arguments: Any) -> ModelResponse:
    response = calls((name, ""))
    call = response.message.tool_calls[0].model_copy(update={"arguments": json.dumps(arguments)})
    message = response.message.model_copy(update={"tool_calls": (call,)})
    return response.model_copy(update={"message": message})


async def echo_tool(args: dict[str, Any], ctx: ToolContext) -> Any:
    return {"echo": args}


# -- the prompt follows the agent --------------------------------------------------------------


async def test_a_turn_gets_its_own_agents_prompt_in_a_session_another_agent_started() -> None:
    profiles = {"agents": [{"name": "a", "system_prompt": "I am A"}, {"name": "b"}]}
    # the model answers by the prompt it is given (its "agent:" prefix taken off)
    w = world(profiles, {"I am A": lambda r: says("from a"), "b": lambda r: says("from b")})
    await w.run(request("a", "one", turn_id="T1"))
    await w.run(request("b", "two", turn_id="T2"))
    prompts = [r.messages[0].content for _, r in w.model.requests]
    assert prompts == ["I am A", "agent:b"]
    assert w.result("T2").content == "from b"


async def test_an_edited_prompt_reaches_a_session_that_exists() -> None:
    first = world(
        {"agents": [{"name": "a", "system_prompt": "agent:a"}]}, {"a": lambda r: says("1")}
    )
    await first.run(request("a", "one", turn_id="T1"))
    edited = world(
        {"agents": [{"name": "a", "system_prompt": "agent:a (edited)"}]},
        {"a (edited)": lambda r: says("2")},
        store=first.store,
    )
    await edited.run(request("a", "two", turn_id="T2"))
    ((_, asked),) = edited.model.requests
    assert asked.messages[0].content == "agent:a (edited)"
    assert [m.content for m in asked.messages[1:]] == ["one", "1", "two"]


async def test_the_prompt_version_and_the_models_are_recorded() -> None:
    profiles = {"agents": [{"name": "a", "prompt_version": "v7"}, {"name": "b"}]}
    answered = says("done").model_copy(update={"model": "gpt-x-2026"})
    w = world(profiles, {"a": lambda r: answered, "b": lambda r: answered})
    await w.run(request("a", "hi", turn_id="T1"))
    await w.run(request("b", "hi", turn_id="T2"))
    a, b = w.result("T1"), w.result("T2")
    assert (a.prompt_version, a.models) == ("v7", ("gpt-x-2026",))
    assert b.prompt_version is not None and len(b.prompt_version) == 12  # a hash of the prompt
    started = next(e for e in w.events.events if e.type == "turn.started" and e.turn_id == "T1")
    assert started.data.prompt_version == "v7"  # type: ignore[union-attr]
    step = next(e for e in w.events.events if e.type == "step.completed" and e.turn_id == "T1")
    assert step.data.model == "gpt-x-2026"  # type: ignore[union-attr]


# -- stop and continue ---------------------------------------------------------------------------


class Signals(Hook):
    """After each step: stop, continue, or both, as the test says for that step index."""

    def __init__(self, plan: dict[int, tuple[str, ...]], note: str | None = None) -> None:
        self.plan = plan
        self.note = note
        self.steps: list[AgentStep] = []

    async def after_step(self, ctx: HookContext, step: AgentStep) -> None:
        for signal in self.plan.get(ctx.step, ()):
            if signal == "stop":
                ctx.stop("stopper", "enough")
            else:
                ctx.continue_turn("checker", self.note)


def looping(request: ModelRequest) -> ModelResponse:
    return calls_tool("echo", n=len(tool_results(request)))


async def stored_steps(w: Any, turn_id: str = "T1") -> list[AgentStep]:
    return [e.data for e in w.events.events if e.type == "step.completed" and e.turn_id == turn_id]


async def test_a_stop_without_a_continuation_stops_the_turn() -> None:
    w = world(
        {"agents": [{"name": "a"}]},
        {"a": looping},
        Signals({0: ("stop",)}),
        tools={"echo": echo_tool},
    )
    await w.run(request("a", "go"))
    result = w.result("T1")
    assert (result.finish_reason, result.stopped_by, result.steps) == ("stop", "stopper", 1)


async def test_a_continuation_overrides_a_stop_of_the_same_step() -> None:
    hook = Signals({0: ("stop", "continue"), 1: ("stop",)})
    w = world({"agents": [{"name": "a"}]}, {"a": looping}, hook, tools={"echo": echo_tool})
    await w.run(request("a", "go"))
    result = w.result("T1")
    assert (result.finish_reason, result.stopped_by, result.steps) == ("stop", "stopper", 2)
    history = w.store.histories["S1"]
    assert sum(1 for m in history if m.role == "tool") == 2


async def test_after_a_final_answer_a_hook_asks_for_one_more_step() -> None:
    def answer(request: ModelRequest) -> ModelResponse:
        return says("checked" if last_user(request) == "check your answer" else "draft")

    hook = Signals({0: ("continue",)}, note="check your answer")
    w = world({"agents": [{"name": "a"}]}, {"a": answer}, hook)
    await w.run(request("a", "go"))
    result = w.result("T1")
    assert (result.content, result.steps, result.finish_reason) == ("checked", 2, "stop")
    history = [(m.role, m.content) for m in w.store.histories["S1"]]
    assert history == [
        ("user", "go"),
        ("assistant", "draft"),
        ("user", "check your answer"),
        ("assistant", "checked"),
    ]


async def test_a_continuation_is_bounded_by_the_iteration_cap() -> None:
    hook = Signals({i: ("continue",) for i in range(10)}, note="again")
    w = world(
        {"agents": [{"name": "a", "limits": {"max_tool_iterations": 3}}]},
        {"a": lambda r: says(f"answer {len(r.messages)}")},
        hook,
    )
    await w.run(request("a", "go"))
    result = w.result("T1")
    assert result.steps == 3 and result.finish_reason == "stop"


async def test_the_step_records_say_who_stopped_and_who_continued() -> None:
    hook = Hooks([Signals({0: ("stop", "continue"), 1: ("stop",)})])
    w = world({"agents": [{"name": "a"}]}, {"a": looping}, hook, tools={"echo": echo_tool})
    await w.run(request("a", "go"))
    records = [r.step for r in w.store.steps["S1", "T1"]]  # the turn's step list
    assert [(s.stopped_by, s.continued_by) for s in records] == [
        ("stopper", "checker"),
        ("stopper", None),
    ]


# -- the built-in guards --------------------------------------------------------------------------


async def test_tool_guard_blocks_by_tool_and_by_argument_pattern() -> None:
    config = ToolGuardConfig.model_validate(
        {
            "rules": [
                {
                    "tool": "refund",
                    "arguments": {"amount": "^[0-9]{4,}$"},
                    "message": "ask a human",
                },
                {"arguments": {"*": "(?i)drop table"}, "message": "no SQL"},
            ]
        }
    )
    asked = iter(
        [
            calls_tool("refund", amount=25000),
            calls_tool("refund", amount=25),
            calls_tool("lookup", q="x; DROP TABLE users"),
            says("done"),
        ]
    )
    w = world(
        {"agents": [{"name": "a", "limits": {"empty_streak_after": 0}}]},
        {"a": lambda r: next(asked)},
        ToolGuard(config),
        tools={"refund": echo_tool, "lookup": echo_tool},
    )
    await w.run(request("a", "go"))
    seen = [m.content for m in w.store.histories["S1"] if m.role == "tool"]
    assert seen == [
        json.dumps({"error": "blocked: ask a human"}),
        json.dumps({"echo": {"amount": 25}}),
        json.dumps({"error": "blocked: no SQL"}),
    ]


async def test_content_guard_stops_a_turn_and_withholds_the_output() -> None:
    config = ContentGuardConfig.model_validate(
        {"rules": [{"name": "card", "pattern": r"\b(?:\d[ -]?){13,16}\b", "replacement": "No."}]}
    )
    w = world(
        {"agents": [{"name": "a"}]},
        {"a": lambda r: says("your card is 4111 1111 1111 1111")},
        ContentGuard(config),
    )
    await w.run(request("a", "go"))
    result = w.result("T1")
    assert (result.finish_reason, result.stopped_by, result.content) == (
        "stop",
        "content_guard:card",
        "No.",
    )
    assert "4111" not in json.dumps([m.content for m in w.store.histories["S1"]])


def test_guard_configs_refuse_bad_patterns() -> None:
    with pytest.raises(ValueError, match="not a regular expression"):
        ToolGuardConfig.model_validate({"rules": [{"arguments": {"q": "("}}]})
    with pytest.raises(ValueError, match="not a regular expression"):
        ContentGuardConfig.model_validate({"rules": [{"name": "x", "pattern": "["}]})


# -- the model router -----------------------------------------------------------------------------


class Failing:
    def __init__(self, code: str | None, name: str) -> None:
        self.code = code
        self.name = name
        self.asked: list[ModelRequest] = []

    def complete(self, request: ModelRequest) -> Awaitable[ModelResponse]:
        self.asked.append(request)
        return self._answer()

    async def _answer(self) -> ModelResponse:
        if self.code is not None:
            raise ModelError("no", code=self.code)
        message = ChatMessage(role="assistant", content=f"from {self.name}")
        return ModelResponse(message=message, provider=self.name)


@pytest.mark.parametrize(
    ("code", "answered"),
    [("model_http_503", "backup"), ("model_unavailable", "backup"), ("model_http_400", None)],
)
async def test_the_router_falls_back_on_errors_retries_did_not_fix(
    code: str, answered: str | None
) -> None:
    primary, backup = Failing(code, "primary"), Failing(None, "backup")
    fell: list[tuple[str, str]] = []
    router = ModelRouter(
        {"default": primary, "backup": backup}, on_fallback=lambda p, c: fell.append((p, c))
    )
    request = ModelRequest(messages=(), model="big", fallbacks=(("backup", "small"),))
    if answered is None:
        with pytest.raises(ModelError):
            await router.complete(request)
        assert not backup.asked
        return
    response = await router.complete(request)
    assert response.provider == answered
    assert [r.model for r in backup.asked] == ["small"]
    assert fell == [("default", code)]


# -- the example of docs/hooks.md ---------------------------------------------------------------


def install_example(tmp_path: Path) -> None:
    """The python block of docs/hooks.md as the module mypkg.guards under ``tmp_path``."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "hooks.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "guards.py").write_text(code)


async def test_the_hook_example_in_the_docs_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_example(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    profiles = AgentProfiles.model_validate(
        {
            "agents": [
                {
                    "name": "a",
                    "hooks": ["mypkg.guards:NoRefundsOver"],
                    "hook_config": {"mypkg.guards:NoRefundsOver": {"limit": 100}},
                }
            ]
        }
    )
    hook = HookSets(profiles).for_agent("a")
    asked = iter(
        [
            calls_tool("refund", amount=500),
            says("a refund of 50"),
            says("checked: a refund of 50 is fine"),  # mentions a refund: checked once a turn
        ]
    )
    w = world(
        {"agents": [{"name": "a", "limits": {"empty_streak_after": 0}}]},
        {"a": lambda r: next(asked)},
        hook,
        tools={"refund": echo_tool},
    )
    await w.run(request("a", "refund me"))
    history = [(m.role, m.content) for m in w.store.histories["S1"]]
    assert history[2] == ("tool", json.dumps({"error": "blocked: refunds over 100 need a human"}))
    assert history[-2][0] == "user" and "no refund over the limit" in (history[-2][1] or "")
    assert w.result("T1").content == "checked: a refund of 50 is fine"
    assert w.result("T1").steps == 3


async def test_a_spent_budget_ends_the_turn_whatever_a_hook_asks() -> None:
    hook = Signals({i: ("continue",) for i in range(10)}, note="again")
    w = world(
        {"agents": [{"name": "a", "budget": {"max_total_tokens": 15}}]},
        {"a": lambda r: says("answer", tokens=10)},
        hook,
    )
    await w.run(request("a", "go"))
    result = w.result("T1")
    # two answers continued (10, then 20 tokens: checked before each call, the budget holds
    # for the second); before the third call it is spent: that last call's answer ends the
    # turn though the hook asked for more
    assert (result.finish_reason, result.stopped_by) == ("budget", "turn.max_total_tokens")
    assert result.steps == 3
