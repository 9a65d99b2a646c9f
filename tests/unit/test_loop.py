"""The turn loop, end to end through the scripted model reached via the real ``openai`` client.

Every test asserts what a user of the loop sees: the ``TurnResult``, the session
history in ``MemoryStore``, the JSON bodies the model received and the events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import httpx2
import openai
import pytest

from contracts.codec import encode_stored
from contracts.events import StepCompleted, ToolInvoked, TurnFinished
from contracts.messages import ChatMessage, Usage
from contracts.state import AgentState, AgentStep, ModelResponse, StepExecution, ToolExecution
from contracts.tools import ToolCallReply, ToolContext, ToolDefinition
from contracts.turns import (
    InputMessage,
    LimitOverrides,
    LoopLimits,
    TurnError,
    TurnRequest,
    TurnResult,
)
from tests.hook_fixtures.hooks import StopAt
from worker.errors import RetryableError, StaleStateError, ToolUnavailableError
from worker.loop import (
    Blocked,
    Finished,
    Hook,
    HookContext,
    Loop,
    RunAgain,
    ToolInvocation,
    new_execution,
)
from worker.model.adapter import OpenAIModel
from worker.model.http import ModelHttpClient
from worker.profiles.agents import AgentProfile
from worker.session.handle import ParkedState
from worker.testing.memory import FunctionTools, ListSink, MemoryStore, StaticCatalog, ToolFunction
from worker.testing.scripted_model import Reply, ScriptedModel

PROMPT = "You are the support agent of ACME."
SESSION = "s1"

MakeModel = Callable[..., OpenAIModel]


# -- building blocks ------------------------------------------------------------------------


@pytest.fixture
async def make_model(scripted_model: ScriptedModel) -> AsyncIterator[MakeModel]:
    """Adapters over real openai clients pointed at the scripted model, on the HTTP client the
    worker uses; all closed afterwards."""
    clients: list[openai.AsyncOpenAI] = []

    def factory(*, max_retries: int = 0, bad_response_retries: int = 2) -> OpenAIModel:
        client = openai.AsyncOpenAI(
            base_url=scripted_model.base_url,
            api_key="test",
            max_retries=max_retries,
            http_client=ModelHttpClient(timeout=httpx2.Timeout(30, connect=5)),
        )
        clients.append(client)
        return OpenAIModel(
            client, model="scripted-model", bad_response_retries=bad_response_retries
        )

    try:
        yield factory
    finally:
        for client in clients:
            await client.close()


@dataclasses.dataclass
class Rig:
    loop: Loop
    store: MemoryStore
    sink: ListSink
    tools: FunctionTools

    def history(self, session_id: str = SESSION) -> list[ChatMessage]:
        return self.store.histories.get(session_id, [])

    def events_of(self, event_type: str) -> list[Any]:
        return [e for e in self.sink.events if e.type == event_type]


def tool_def(name: str, *, timeout_s: float = 5.0) -> ToolDefinition:
    return ToolDefinition(
        name=name,
        description=f"The {name} tool.",
        parameters={"type": "object", "properties": {"q": {"type": "string"}}},
        timeout_s=timeout_s,
    )


def build(
    model: OpenAIModel,
    functions: Mapping[str, ToolFunction],
    *,
    definitions: Sequence[ToolDefinition] | None = None,
    hooks: Hook | None = None,
    store: MemoryStore | None = None,
) -> Rig:
    tools = FunctionTools(functions)
    catalog = definitions if definitions is not None else [tool_def(n) for n in functions]
    store = store if store is not None else MemoryStore()
    sink = ListSink()
    loop = Loop(
        model=model,
        tools=tools,
        catalog=StaticCatalog(catalog),
        store=store,
        events=sink,
        hooks=hooks,
    )
    return Rig(loop=loop, store=store, sink=sink, tools=tools)


def profile(limits: LoopLimits | None = None, **fields: Any) -> AgentProfile:
    return AgentProfile(
        name="support", system_prompt=PROMPT, limits=limits or LoopLimits(), **fields
    )


def turn(
    text: str = "hello",
    *,
    turn_id: str = "t1",
    limits: LimitOverrides | None = None,
    persist: bool = True,
) -> TurnRequest:
    return TurnRequest(
        turn_id=turn_id,
        session_id=SESSION,
        agent="support",
        input=(InputMessage(content=text),),
        limits=limits or LimitOverrides(),
        persist=persist,
    )


async def echo(args: dict[str, Any], ctx: ToolContext) -> Any:
    """A tool that returns ``args["result"]`` (or raises ``args["fail"]``)."""
    if "fail" in args:
        raise RuntimeError(args["fail"])
    return args.get("result", {"status": "ok"})


def call(name: str, call_id: str, **arguments: Any) -> tuple[str, dict[str, Any], str]:
    return (name, arguments, call_id)


def with_usage(reply: Reply, prompt: int, completion: int) -> Reply:
    return dataclasses.replace(reply, usage=(prompt, completion))


def tool_content(body: dict[str, Any], call_id: str) -> str:
    """The content of the tool message answering ``call_id`` in a request body (exactly one)."""
    found = [
        m["content"]
        for m in body["messages"]
        if m["role"] == "tool" and m.get("tool_call_id") == call_id
    ]
    assert len(found) == 1, f"{len(found)} tool messages for {call_id} in the request"
    content = found[0]
    assert isinstance(content, str)
    return content


def error_of(content: str) -> str:
    """The message of a tool error as the model reads it: ``{"error": "..."}`` and nothing else."""
    parsed = json.loads(content)
    assert isinstance(parsed, dict)
    assert list(parsed) == ["error"]
    message = parsed["error"]
    assert isinstance(message, str)
    assert message.strip()
    return message


def assert_transcript(messages: Sequence[ChatMessage | dict[str, Any]]) -> None:
    """Each assistant tool call is followed by exactly one tool result carrying its id."""
    wire = [m.model_dump() if isinstance(m, ChatMessage) else m for m in messages]
    i = 0
    while i < len(wire):
        message = wire[i]
        assert message["role"] != "tool", f"tool message #{i} answers no preceding call"
        i += 1
        if message["role"] != "assistant" or not message.get("tool_calls"):
            continue
        ids = [c["id"] for c in message["tool_calls"]]
        results = wire[i : i + len(ids)]
        assert [r["role"] for r in results] == ["tool"] * len(ids), "a tool call has no result"
        assert [r["tool_call_id"] for r in results] == ids
        i += len(ids)


async def finish(loop: Loop, state: AgentState, agent: AgentProfile) -> TurnResult:
    """Drive ``loop.step`` until the turn is over, the way the distributed worker does."""
    outcome = await loop.step(state, agent)
    for _ in range(20):
        if not isinstance(outcome, RunAgain):
            return outcome.result
        outcome = await loop.step(outcome.state, agent)
    raise AssertionError("the turn did not finish in 20 steps")


# -- 1. iteration cap -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile_cap", "override", "expected"),
    [(None, None, 7), (None, 2, 2), (3, None, 3), (3, 5, 5), (4, 1, 1)],
)
async def test_iteration_cap_ends_turn_with_last_content(
    scripted_model: ScriptedModel,
    make_model: MakeModel,
    profile_cap: int | None,
    override: int | None,
    expected: int,
) -> None:
    for i in range(expected):
        # The last response says nothing: the turn keeps the last non-empty content.
        content = None if i == expected - 1 else f"note {i}"
        scripted_model.expect(Reply.tool_calls(call("lookup", f"c{i}", q=str(i)), content=content))
    rig = build(make_model(), {"lookup": echo})
    limits = LoopLimits() if profile_cap is None else LoopLimits(max_tool_iterations=profile_cap)
    request = turn(limits=LimitOverrides(max_tool_iterations=override))

    finished = await rig.loop.run_turn(None, request, profile(limits))

    result = finished.result
    assert result.finish_reason == "max_iterations"
    assert result.content == (f"note {expected - 2}" if expected > 1 else None)
    assert result.steps == expected
    assert result.error is None
    assert len(scripted_model.requests) == expected
    assert len(rig.tools.calls) == expected
    history = rig.history()
    assert_transcript(history)
    assert history[-1].role == "tool"
    assert history[-1].tool_call_id == f"c{expected - 1}"
    assert len(history) == 1 + 2 * expected
    assert rig.sink.types()[-1] == "turn.completed"
    assert rig.store.results[SESSION, "t1"] == result


async def test_answer_before_cap_is_a_stop(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(Reply.tool_calls(call("lookup", "c0"), content="checking"))
    scripted_model.expect(Reply.text("It shipped."))
    rig = build(make_model(), {"lookup": echo})

    finished = await rig.loop.run_turn(
        None, turn(limits=LimitOverrides(max_tool_iterations=2)), profile()
    )

    assert finished.result.finish_reason == "stop"
    assert finished.result.content == "It shipped."
    assert finished.result.steps == 2


# -- 2. empty-streak guard ------------------------------------------------------------------

CUSTOM_HINT = "HINT: :count searches in a row came back empty; answer now."
EMPTY: dict[str, Any] = {"items": []}
FOUND: dict[str, Any] = {"items": ["order 17"]}
NEUTRAL: dict[str, Any] = {"status": "sent", "id": 3}
FAIL: dict[str, Any] = {"fail": "index offline"}


@pytest.mark.parametrize(
    ("profile_limits", "override", "outcomes", "hints"),
    [
        pytest.param(
            {},
            None,
            [EMPTY, {"results": [], "data": None}, FOUND, {"matches": []}, {"passages": ""}],
            [None, 2, None, None, 2],
            id="default-threshold-and-hint",
        ),
        pytest.param(
            {"empty_streak_hint": CUSTOM_HINT},
            None,
            [
                EMPTY,
                NEUTRAL,
                FAIL,
                "plain text, no keys",
                {"passages": [], "note": "not a result key"},
                {"items": [], "results": ["r1"]},
                {"data": {}},
            ],
            [None, None, 2, None, 3, None, None],
            id="neutral-keeps-error-counts-partial-found-resets",
        ),
        pytest.param(
            {"empty_streak_hint": CUSTOM_HINT, "empty_streak_after": 3},
            None,
            [EMPTY, EMPTY, EMPTY, EMPTY],
            [None, None, 3, 4],
            id="profile-threshold-3",
        ),
        pytest.param(
            {"empty_streak_hint": CUSTOM_HINT},
            1,
            [{"data": []}, FOUND, {"results": None}],
            [1, None, 1],
            id="override-threshold-1",
        ),
        pytest.param(
            {"empty_streak_hint": CUSTOM_HINT},
            0,
            [EMPTY, FAIL, EMPTY, EMPTY],
            [None, None, None, None],
            id="zero-disables",
        ),
    ],
)
async def test_empty_streak_hint(
    scripted_model: ScriptedModel,
    make_model: MakeModel,
    profile_limits: dict[str, Any],
    override: int | None,
    outcomes: list[Any],
    hints: list[int | None],
) -> None:
    for i, outcome in enumerate(outcomes):
        arguments = outcome if outcome is FAIL else {"result": outcome}
        scripted_model.expect(Reply.tool_calls(call("search", f"c{i}", **arguments)))
    scripted_model.expect(Reply.text("Here is what I found."))
    limits = LoopLimits(max_tool_iterations=20, **profile_limits)
    rig = build(make_model(), {"search": echo})

    finished = await rig.loop.run_turn(
        None, turn(limits=LimitOverrides(empty_streak_after=override)), profile(limits)
    )

    assert finished.result.finish_reason == "stop"
    assert finished.result.content == "Here is what I found."
    stored = {m.tool_call_id: m.content for m in rig.history() if m.role == "tool"}
    for i, (outcome, count) in enumerate(zip(outcomes, hints, strict=True)):
        seen = tool_content(scripted_model.requests[i + 1], f"c{i}")
        assert stored[f"c{i}"] == seen
        suffix = (
            "" if count is None else "\n\n" + limits.empty_streak_hint.replace(":count", str(count))
        )
        assert seen.endswith(suffix), f"call {i}: {seen!r}"
        own_text = seen.removesuffix(suffix)
        # The tool's own text is still there, untouched.
        if outcome is FAIL:
            assert "index offline" in error_of(own_text)
        elif isinstance(outcome, str):
            assert own_text == outcome
        else:
            assert json.loads(own_text) == outcome
        if count is None:
            assert "HINT" not in seen
            assert "found nothing" not in seen
    if profile_limits == {}:
        assert "Your last 2 searches found nothing" in tool_content(
            scripted_model.requests[2], "c1"
        )


async def test_empty_streak_judges_parallel_calls_in_call_order(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    limits = LoopLimits(empty_streak_hint=CUSTOM_HINT)
    hint = "\n\n" + CUSTOM_HINT
    scripted_model.expect(
        Reply.tool_calls(call("search", "a0", result=EMPTY), call("search", "a1", result=EMPTY))
    )
    scripted_model.expect(
        Reply.tool_calls(call("search", "b0", result=EMPTY), call("search", "b1", result=FOUND))
    )
    scripted_model.expect(Reply.tool_calls(call("search", "c0", result=EMPTY)))
    scripted_model.expect(Reply.text("done"))
    rig = build(make_model(), {"search": echo})

    await rig.loop.run_turn(None, turn(), profile(limits))

    requests = scripted_model.requests
    assert tool_content(requests[1], "a0") == json.dumps(EMPTY)
    assert tool_content(requests[1], "a1") == json.dumps(EMPTY) + hint.replace(":count", "2")
    assert tool_content(requests[2], "b0") == json.dumps(EMPTY) + hint.replace(":count", "3")
    assert tool_content(requests[2], "b1") == json.dumps(FOUND)
    assert tool_content(requests[3], "c0") == json.dumps(EMPTY)


# -- 3. tool failures go back to the model ----------------------------------------------------


async def _explode(args: dict[str, Any], ctx: ToolContext) -> Any:
    raise ValueError("account 42 is locked")


async def _hang(args: dict[str, Any], ctx: ToolContext) -> Any:
    await asyncio.sleep(5)
    return "too late"


@pytest.mark.parametrize(
    ("reply", "needles", "called"),
    [
        pytest.param(
            Reply.tool_calls(call("explode", "c1")),
            ["account 42 is locked"],
            ["explode"],
            id="exception",
        ),
        pytest.param(
            Reply.tool_calls(call("hang", "c1")), ["timed out", "hang"], ["hang"], id="timeout"
        ),
        pytest.param(
            Reply.tool_calls(call("hidden", "c1")),
            ["unknown tool", "hidden"],
            [],
            id="unknown-tool",
        ),
        pytest.param(
            Reply.raw_tool_call("lookup", '{"q": ', call_id="c1"),
            ["not valid JSON"],
            [],
            id="invalid-json",
        ),
        pytest.param(
            Reply.raw_tool_call("lookup", '["q"]', call_id="c1"),
            ["JSON object"],
            [],
            id="arguments-not-an-object",
        ),
    ],
)
async def test_tool_failure_comes_back_as_error(
    scripted_model: ScriptedModel,
    make_model: MakeModel,
    reply: Reply,
    needles: list[str],
    called: list[str],
) -> None:
    scripted_model.expect(reply)
    scripted_model.expect(Reply.text("Sorry, I could not do that."))
    counts: Counter[str] = Counter()

    def counted(name: str, function: ToolFunction) -> ToolFunction:
        async def run(args: dict[str, Any], ctx: ToolContext) -> Any:
            counts[name] += 1
            return await function(args, ctx)

        return run

    functions = {"lookup": echo, "explode": _explode, "hang": _hang, "hidden": echo}
    # "hidden" exists as a function but is not in the catalog: the model cannot reach it.
    definitions = [tool_def("lookup"), tool_def("explode"), tool_def("hang", timeout_s=0.2)]
    rig = build(
        make_model(),
        {name: counted(name, f) for name, f in functions.items()},
        definitions=definitions,
    )

    started = time.monotonic()
    finished = await rig.loop.run_turn(None, turn(), profile())
    elapsed = time.monotonic() - started

    assert elapsed < 2.0
    result = finished.result
    assert result.finish_reason == "stop"
    assert result.content == "Sorry, I could not do that."
    assert result.error is None
    message = error_of(tool_content(scripted_model.requests[1], "c1"))
    for needle in needles:
        assert needle in message
    assert sorted(counts.elements()) == called
    [invoked] = rig.events_of("tool.invoked")
    assert isinstance(invoked.data, ToolInvoked)
    assert invoked.data.outcome == "error"
    assert invoked.data.error == message
    assert_transcript(rig.history())
    assert rig.sink.types()[-1] == "turn.completed"


async def test_failures_in_one_step_each_get_their_error(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(
        Reply.tool_calls(
            call("explode", "e1"),
            call("hang", "h1"),
            call("nope", "n1"),
            call("lookup", "l1", result={"status": "fine"}),
        )
    )
    scripted_model.expect(Reply.text("Partial answer."))
    definitions = [tool_def("lookup"), tool_def("explode"), tool_def("hang", timeout_s=0.2)]
    rig = build(
        make_model(), {"lookup": echo, "explode": _explode, "hang": _hang}, definitions=definitions
    )

    finished = await rig.loop.run_turn(
        None, turn(limits=LimitOverrides(empty_streak_after=0)), profile()
    )

    assert finished.result.content == "Partial answer."
    body = scripted_model.requests[1]
    assert "account 42 is locked" in error_of(tool_content(body, "e1"))
    assert "timed out" in error_of(tool_content(body, "h1"))
    assert "unknown tool" in error_of(tool_content(body, "n1"))
    assert json.loads(tool_content(body, "l1")) == {"status": "fine"}
    assert_transcript(body["messages"])
    outcomes = {e.data.call_id: e.data.outcome for e in rig.events_of("tool.invoked")}
    assert outcomes == {"e1": "error", "h1": "error", "n1": "error", "l1": "ok"}


# -- 4. truncation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "value", "limit"),
    [
        pytest.param(None, "".join(str(i % 10) for i in range(20_000)), 16_000, id="default"),
        pytest.param(300, {"items": ["a" * 200, "b" * 200]}, 300, id="override"),
    ],
)
async def test_tool_result_is_truncated_with_marker(
    scripted_model: ScriptedModel,
    make_model: MakeModel,
    override: int | None,
    value: Any,
    limit: int,
) -> None:
    scripted_model.expect(
        Reply.tool_calls(call("fetch", "big", result=value), call("fetch", "small", result="ok"))
    )
    scripted_model.expect(Reply.text("done"))
    rig = build(make_model(), {"fetch": echo})

    await rig.loop.run_turn(
        None, turn(limits=LimitOverrides(max_tool_result_chars=override)), profile()
    )

    full = value if isinstance(value, str) else json.dumps(value)
    assert len(full) > limit
    seen = tool_content(scripted_model.requests[1], "big")
    assert seen[:limit] == full[:limit]
    marker = seen[limit:]
    assert not full[limit:].startswith(marker)
    assert "truncated" in marker
    assert str(len(full) - limit) in marker
    assert len(marker) < 100
    assert tool_content(scripted_model.requests[1], "small") == "ok"
    truncated = {e.data.call_id: e.data.truncated for e in rig.events_of("tool.invoked")}
    assert truncated == {"big": True, "small": False}
    stored = next(m for m in rig.history() if m.tool_call_id == "big")
    assert stored.content == seen


# -- 5. parallel tool calls -----------------------------------------------------------------


async def test_parallel_calls_run_concurrently_and_record_in_call_order(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    first_started, second_started, second_done = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def first(args: dict[str, Any], ctx: ToolContext) -> Any:
        first_started.set()
        await second_started.wait()  # deadlocks (and times out) unless both run at once
        await second_done.wait()  # finish after the second call
        return {"from": "first"}

    async def second(args: dict[str, Any], ctx: ToolContext) -> Any:
        second_started.set()
        await first_started.wait()
        second_done.set()
        return {"from": "second"}

    scripted_model.expect(Reply.tool_calls(call("first", "p1"), call("second", "p2")))
    scripted_model.expect(Reply.text("both done"))
    definitions = [tool_def("first", timeout_s=2), tool_def("second", timeout_s=2)]
    rig = build(make_model(), {"first": first, "second": second}, definitions=definitions)

    finished = await rig.loop.run_turn(None, turn(), profile())

    assert finished.result.content == "both done"
    body = scripted_model.requests[1]
    tools = [m for m in body["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == ["p1", "p2"]
    assert [json.loads(m["content"]) for m in tools] == [{"from": "first"}, {"from": "second"}]
    assert [m.tool_call_id for m in rig.history() if m.role == "tool"] == ["p1", "p2"]
    # The second call really finished first.
    assert [e.data.call_id for e in rig.events_of("tool.invoked")] == ["p2", "p1"]


# -- 6. transcript and persistence ----------------------------------------------------------


@pytest.mark.parametrize("content", [None, ""])
async def test_assistant_message_recorded_without_content(
    scripted_model: ScriptedModel, make_model: MakeModel, content: str | None
) -> None:
    scripted_model.expect(
        Reply.tool_calls(call("lookup", "x1", q="a"), call("lookup", "x2"), content=content)
    )
    scripted_model.expect(Reply.tool_calls(call("lookup", "x3")))
    scripted_model.expect(Reply.text("final"))
    rig = build(make_model(), {"lookup": echo})

    await rig.loop.run_turn(None, turn(), profile())

    history = rig.history()
    assert [m.role for m in history] == [
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert history[1].content == content
    assert [c.id for c in history[1].tool_calls] == ["x1", "x2"]
    assert json.loads(history[1].tool_calls[0].arguments) == {"q": "a"}
    assert [m.tool_call_id for m in history if m.role == "tool"] == ["x1", "x2", "x3"]
    assert_transcript(history)
    # The model is shown the same transcript.
    last = scripted_model.requests[2]["messages"]
    assert_transcript(last)
    assert last[2] == {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {
                "id": "x1",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"q": "a"}'},
            },
            {"id": "x2", "type": "function", "function": {"name": "lookup", "arguments": "{}"}},
        ],
    }
    assert [m["tool_call_id"] for m in last if m["role"] == "tool"] == ["x1", "x2", "x3"]


async def test_persisted_turns_build_the_session_history(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(Reply.tool_calls(call("lookup", "k1", q="17")))
    scripted_model.expect(Reply.text("Order 17 shipped."))
    scripted_model.expect(Reply.text("You're welcome."))
    rig = build(make_model(), {"lookup": echo})

    first = await rig.loop.run_turn(None, turn("where is order 17?"), profile())
    state = await rig.store.load(SESSION)
    assert state is not None
    second = await rig.loop.run_turn(state, turn("thanks", turn_id="t2"), profile())

    assert (first.result.content, second.result.content) == ("Order 17 shipped.", "You're welcome.")
    history = rig.history()
    assert [(m.role, m.content) for m in history] == [
        ("user", "where is order 17?"),
        ("assistant", None),
        ("tool", json.dumps({"status": "ok"})),
        ("assistant", "Order 17 shipped."),
        ("user", "thanks"),
        ("assistant", "You're welcome."),
    ]
    assert history[2].tool_call_id == "k1"
    assert_transcript(history)
    seen = scripted_model.requests[2]["messages"]
    assert [(m["role"], m["content"]) for m in seen] == [
        ("system", PROMPT),
        *[(m.role, m.content) for m in history[:5]],
    ]
    assert_transcript(seen)
    final = await rig.store.load(SESSION)
    assert final is not None
    assert final.history_len == len(history)
    assert final.execution is None
    assert final.execution_count == 2


async def test_persist_false_leaves_session_history_untouched(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(Reply.text("Hi, how can I help?"))
    scripted_model.expect(Reply.tool_calls(call("lookup", "tmp1", q="17")))
    scripted_model.expect(Reply.text("Order 17 shipped."))
    scripted_model.expect(Reply.text("Anything else?"))
    rig = build(make_model(), {"lookup": echo})

    await rig.loop.run_turn(None, turn("hello"), profile())
    before = list(rig.history())
    state = await rig.store.load(SESSION)
    transient = await rig.loop.run_turn(
        state, turn("status of 17?", turn_id="t2", persist=False), profile()
    )
    after_transient = list(rig.history())
    state = await rig.store.load(SESSION)
    await rig.loop.run_turn(state, turn("thanks", turn_id="t3"), profile())

    assert transient.result.content == "Order 17 shipped."
    assert after_transient == before
    assert [m.content for m in before] == ["hello", "Hi, how can I help?"]
    # Inside the transient turn the model sees its own tool step.
    inside = scripted_model.requests[2]["messages"]
    assert [m["role"] for m in inside] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "tool",
    ]
    assert inside[-1]["tool_call_id"] == "tmp1"
    # The next turn does not.
    later = scripted_model.requests[3]["messages"]
    assert [(m["role"], m["content"]) for m in later] == [
        ("system", PROMPT),
        ("user", "hello"),
        ("assistant", "Hi, how can I help?"),
        ("user", "thanks"),
    ]
    assert [m.content for m in rig.history()] == [
        "hello",
        "Hi, how can I help?",
        "thanks",
        "Anything else?",
    ]
    assert rig.store.transient == {}
    assert rig.store.results[SESSION, "t2"] == transient.result


async def test_persist_false_turn_ending_at_the_cap_stores_nothing(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(Reply.text("Hi."))
    scripted_model.expect(Reply.tool_calls(call("lookup", "tmp1"), content="checking"))
    rig = build(make_model(), {"lookup": echo})
    await rig.loop.run_turn(None, turn("hello"), profile())
    before = list(rig.history())
    state = await rig.store.load(SESSION)
    assert state is not None

    request = turn(
        "skill", turn_id="t2", persist=False, limits=LimitOverrides(max_tool_iterations=1)
    )
    finished = await rig.loop.run_turn(state, request, profile())

    assert finished.result.finish_reason == "max_iterations"
    assert finished.result.content == "checking"
    assert rig.history() == before
    assert rig.store.transient == {}
    after = await rig.store.load(SESSION)
    assert after is not None
    assert after.history_len == state.history_len == 2


# -- 7. hooks -------------------------------------------------------------------------------


class Recorder(Hook):
    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.result: TurnResult | None = None

    async def before_execution(self, ctx: HookContext) -> None:
        self.calls.append(("before_execution", ctx.step))

    async def after_execution(self, ctx: HookContext, result: TurnResult) -> None:
        self.calls.append(("after_execution", ctx.step))
        self.result = result

    async def before_step(self, ctx: HookContext) -> None:
        self.calls.append(("before_step", ctx.step))

    async def after_step(self, ctx: HookContext, step: AgentStep) -> None:
        self.calls.append(("after_step", step.index))

    async def prepare_messages(
        self, ctx: HookContext, messages: list[ChatMessage]
    ) -> list[ChatMessage]:
        self.calls.append(("prepare_messages", ctx.step))
        return messages

    async def after_model(self, ctx: HookContext, response: ModelResponse) -> ModelResponse:
        self.calls.append(("after_model", ctx.step))
        return response

    async def before_tool(self, ctx: HookContext, call: ToolInvocation) -> ToolInvocation | Blocked:
        self.calls.append(("before_tool", ctx.step))
        return call

    async def after_tool(self, ctx: HookContext, execution: ToolExecution) -> ToolExecution:
        self.calls.append(("after_tool", ctx.step))
        return execution


async def test_hooks_are_called_at_every_point_but_needs_approval_in_order(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(Reply.tool_calls(call("lookup", "c1")))
    scripted_model.expect(Reply.text("done"))
    recorder = Recorder()
    rig = build(make_model(), {"lookup": echo}, hooks=recorder)

    finished = await rig.loop.run_turn(None, turn(), profile())

    assert recorder.calls == [
        ("before_execution", 0),
        ("before_step", 0),
        ("prepare_messages", 0),
        ("after_model", 0),
        ("before_tool", 0),
        ("after_tool", 0),
        ("after_step", 0),
        ("before_step", 1),
        ("prepare_messages", 1),
        ("after_model", 1),
        ("after_step", 1),
        ("after_execution", 2),
    ]
    assert recorder.result == finished.result


CARD = "4111 1111 1111 1111"


class Redactor(Hook):
    name = "redactor"

    async def prepare_messages(
        self, ctx: HookContext, messages: list[ChatMessage]
    ) -> list[ChatMessage]:
        return [
            m.model_copy(update={"content": m.content.replace(CARD, "[CARD]")}) if m.content else m
            for m in messages
        ]

    async def before_tool(self, ctx: HookContext, call: ToolInvocation) -> ToolInvocation | Blocked:
        restored = {
            k: v.replace("[CARD]", CARD) if isinstance(v, str) else v
            for k, v in call.arguments.items()
        }
        return ToolInvocation(call.call_id, call.name, restored)

    async def after_tool(self, ctx: HookContext, execution: ToolExecution) -> ToolExecution:
        return execution.model_copy(
            update={"content": "redacted: " + execution.content.replace(CARD, "[CARD]")}
        )


async def test_redaction_hooks_rewrite_what_the_model_sees(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    received: list[dict[str, Any]] = []

    async def charge(args: dict[str, Any], ctx: ToolContext) -> Any:
        received.append(args)
        return {"receipt": f"charged card {args['card']}"}

    scripted_model.expect(Reply.tool_calls(call("charge", "ch1", card="[CARD]", amount=5)))
    scripted_model.expect(Reply.text("Charged."))
    rig = build(make_model(), {"charge": charge}, hooks=Redactor())

    finished = await rig.loop.run_turn(None, turn(f"charge my card {CARD}"), profile())

    assert finished.result.content == "Charged."
    assert received == [{"card": CARD, "amount": 5}]  # before_tool restored the value
    for body in scripted_model.requests:
        assert CARD not in json.dumps(body)
    assert scripted_model.requests[0]["messages"][1]["content"] == "charge my card [CARD]"
    seen = tool_content(scripted_model.requests[1], "ch1")
    assert seen == "redacted: " + json.dumps({"receipt": "charged card [CARD]"})
    history = rig.history()
    assert history[0].content == f"charge my card {CARD}"  # the stored history keeps the original
    assert history[2].content == seen  # after_tool ran before the result was recorded


async def test_before_tool_can_block_a_call(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    class Guard(Hook):
        async def before_tool(
            self, ctx: HookContext, call: ToolInvocation
        ) -> ToolInvocation | Blocked:
            return Blocked("refunds need a human") if call.name == "refund" else call

    refunds: list[dict[str, Any]] = []

    async def refund(args: dict[str, Any], ctx: ToolContext) -> Any:
        refunds.append(args)
        return "refunded"

    scripted_model.expect(
        Reply.tool_calls(call("refund", "r1", amount=100), call("lookup", "l1", result="paid"))
    )
    scripted_model.expect(Reply.text("A human will handle the refund."))
    rig = build(make_model(), {"refund": refund, "lookup": echo}, hooks=Guard())

    finished = await rig.loop.run_turn(None, turn(), profile())

    assert finished.result.finish_reason == "stop"
    assert finished.result.content == "A human will handle the refund."
    assert refunds == []
    message = error_of(tool_content(scripted_model.requests[1], "r1"))
    assert "blocked" in message
    assert "refunds need a human" in message
    assert tool_content(scripted_model.requests[1], "l1") == "paid"
    outcomes = {e.data.call_id: e.data.outcome for e in rig.events_of("tool.invoked")}
    assert outcomes == {"r1": "blocked", "l1": "ok"}
    assert_transcript(rig.history())


@pytest.mark.parametrize(
    ("point", "step", "model_calls", "content"),
    [
        ("before_execution", 0, 0, None),
        ("before_step", 0, 0, None),
        ("before_step", 1, 1, "checking"),
        ("prepare_messages", 0, 0, None),
        ("prepare_messages", 1, 1, "checking"),
        ("after_model", 0, 1, "checking"),
        ("after_tool", 0, 1, "checking"),
        ("before_tool", 0, 1, "checking"),
        ("after_step", 0, 1, "checking"),
        ("after_step", 1, 2, "still checking"),
    ],
)
async def test_hook_stop_signal_ends_the_turn(
    scripted_model: ScriptedModel,
    make_model: MakeModel,
    point: str,
    step: int,
    model_calls: int,
    content: str | None,
) -> None:
    script = [
        Reply.tool_calls(call("lookup", "c0"), content="checking"),
        Reply.tool_calls(call("lookup", "c1"), content="still checking"),
    ]
    for reply in script[:model_calls]:
        scripted_model.expect(reply)
    rig = build(make_model(), {"lookup": echo}, hooks=StopAt(StopAt.Config(point=point, step=step)))

    finished = await rig.loop.run_turn(None, turn(), profile())

    result = finished.result
    assert result.finish_reason == "stop"
    assert result.stopped_by == "stop_at"
    assert result.content == content
    assert len(scripted_model.requests) == model_calls
    if point == "after_model":
        # stopped right after the model asked for a tool: the tool is not run, but recorded
        assert rig.tools.calls == []
        [invoked] = rig.events_of("tool.invoked")
        assert invoked.data.outcome == "blocked"
        assert "stopped by stop_at" in (invoked.data.error or "")
    else:
        assert len(rig.tools.calls) == model_calls  # a later stop lets the step's tools finish
    history = rig.history()
    assert len(history) == 1 + 2 * model_calls
    assert_transcript(history)
    assert rig.sink.types()[-1] == "turn.completed"


# -- 8. events ------------------------------------------------------------------------------


async def _slow_lookup(args: dict[str, Any], ctx: ToolContext) -> Any:
    await asyncio.sleep(0.02)
    return {"status": "ok"}


def _script_two_tool_steps(scripted_model: ScriptedModel) -> None:
    scripted_model.expect(Reply.tool_calls(call("lookup", "e0")))
    scripted_model.expect(Reply.tool_calls(call("lookup", "e1")))
    scripted_model.expect(Reply.text("done"))


async def test_events_in_order(scripted_model: ScriptedModel, make_model: MakeModel) -> None:
    _script_two_tool_steps(scripted_model)
    rig = build(make_model(), {"lookup": _slow_lookup})

    finished = await rig.loop.run_turn(None, turn(), profile())

    events = rig.sink.events
    assert [(e.type, e.step) for e in events] == [
        ("turn.started", None),
        ("tool.invoking", 0),
        ("tool.invoked", 0),
        ("step.completed", 0),
        ("tool.invoking", 1),
        ("tool.invoked", 1),
        ("step.completed", 1),
        ("step.completed", 2),
        ("turn.completed", None),
    ]
    assert {(e.turn_id, e.session_id, e.agent) for e in events} == {("t1", SESSION, "support")}
    invoked = [e.data for e in rig.events_of("tool.invoked")]
    assert [(d.call_id, d.tool, d.outcome) for d in invoked] == [
        ("e0", "lookup", "ok"),
        ("e1", "lookup", "ok"),
    ]
    assert all(isinstance(d, ToolInvoked) and d.duration_s >= 0.015 for d in invoked)
    steps = [e.data for e in rig.events_of("step.completed")]
    assert all(isinstance(d, StepCompleted) for d in steps)
    assert [(d.step_type, d.tool_calls, d.finish_reason) for d in steps] == [
        ("tool_execution", 1, "tool_calls"),
        ("tool_execution", 1, "tool_calls"),
        ("final_response", 0, "stop"),
    ]
    # real timings: a step lasts at least its model call, which took time on the wire
    assert all(d.duration_s >= d.model_duration_s > 0 for d in steps)
    last = events[-1].data
    assert isinstance(last, TurnFinished)
    assert last.result == finished.result
    times = [e.time for e in events]
    assert times == sorted(times)


async def test_model_error_emits_turn_failed(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(Reply.error(500, "boom"))
    rig = build(make_model(max_retries=0), {"lookup": echo})

    finished = await rig.loop.run_turn(None, turn(), profile())

    assert rig.sink.types() == ["turn.started", "step.completed", "turn.failed"]
    completed = rig.sink.events[1].data
    assert isinstance(completed, StepCompleted)
    assert (completed.step_type, completed.finish_reason) == ("error", "error")
    data = rig.sink.events[-1].data
    assert isinstance(data, TurnFinished)
    assert data.result == finished.result
    assert (data.result.finish_reason, data.result.steps) == ("error", 1)
    ex = finished.state.execution
    assert ex is None
    # the failed step is recorded with its error, and its type says so
    stored = rig.store.results[SESSION, "t1"]
    assert stored.error is not None and "500" in stored.error.message


async def test_event_ids_are_deterministic(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    model = make_model()

    async def run(turn_id: str) -> list[str]:
        _script_two_tool_steps(scripted_model)
        rig = build(model, {"lookup": echo})
        await rig.loop.run_turn(None, turn(turn_id=turn_id), profile())
        return [e.id for e in rig.sink.events]

    first = await run("t1")
    again = await run("t1")
    other = await run("t2")

    assert first == again
    assert len(set(first)) == len(first) == 9
    assert not set(first) & set(other)


# -- 9. the model adapter -------------------------------------------------------------------


async def test_usage_is_accumulated_per_step_and_turn(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(with_usage(Reply.tool_calls(call("lookup", "u1")), 100, 10))
    scripted_model.expect(with_usage(Reply.tool_calls(call("lookup", "u2")), 130, 12))
    scripted_model.expect(Reply.text("done", usage=(150, 20)))
    rig = build(make_model(), {"lookup": echo})

    finished = await rig.loop.run_turn(None, turn(), profile())

    assert finished.result.usage == Usage(prompt_tokens=380, completion_tokens=42, total_tokens=422)
    per_step = [e.data.usage for e in rig.events_of("step.completed")]
    assert per_step == [
        Usage(prompt_tokens=100, completion_tokens=10, total_tokens=110),
        Usage(prompt_tokens=130, completion_tokens=12, total_tokens=142),
        Usage(prompt_tokens=150, completion_tokens=20, total_tokens=170),
    ]
    assert all(body["model"] == "scripted-model" for body in scripted_model.requests)


async def test_rate_limit_is_retried_by_the_client(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(Reply.error(429, "slow down", headers={"retry-after-ms": "1"}))
    scripted_model.expect(Reply.text("after the retry"))
    rig = build(make_model(max_retries=2), {})

    finished = await rig.loop.run_turn(None, turn(), profile())

    assert finished.result.finish_reason == "stop"
    assert finished.result.content == "after the retry"
    assert len(scripted_model.requests) == 2
    assert scripted_model.requests[0] == scripted_model.requests[1]


async def test_server_error_fails_the_turn(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(Reply.tool_calls(call("lookup", "c0"), content="looking it up"))
    scripted_model.expect(Reply.error(500, "boom"))
    rig = build(make_model(max_retries=0), {"lookup": echo})

    finished = await rig.loop.run_turn(None, turn(), profile())

    result = finished.result
    assert result.finish_reason == "error"
    assert result.error is not None
    assert result.error.code == "model_http_500"
    assert "500" in result.error.message
    assert result.content == "looking it up"
    assert result.steps == 2  # the step whose model call failed is recorded
    assert len(scripted_model.requests) == 2
    assert rig.sink.types()[-1] == "turn.failed"
    assert rig.store.results[SESSION, "t1"] == result
    assert [m.role for m in rig.history()] == ["user", "assistant", "tool"]
    state = await rig.store.load(SESSION)
    assert state is not None
    assert state.execution is None


GARBAGE = [
    pytest.param(b"{not json", id="not-json"),
    pytest.param(b"[]", id="json-array"),
    pytest.param(b'{"object": "chat.completion"}', id="no-choices"),
    pytest.param(b'{"choices": [{"index": 0}]}', id="choice-without-message"),
]


@pytest.mark.parametrize("body", GARBAGE)
async def test_garbage_responses_are_retried_then_fail(
    scripted_model: ScriptedModel, make_model: MakeModel, body: bytes
) -> None:
    for _ in range(3):
        scripted_model.expect(Reply.garbage(body))
    rig = build(make_model(bad_response_retries=2), {})

    finished = await rig.loop.run_turn(None, turn(), profile())

    result = finished.result
    assert result.finish_reason == "error"
    assert result.error is not None
    assert result.error.code == "model_bad_response"
    assert len(scripted_model.requests) == 3
    assert rig.sink.types() == ["turn.started", "step.completed", "turn.failed"]


@pytest.mark.parametrize("body", GARBAGE)
async def test_garbage_then_good_answer_succeeds(
    scripted_model: ScriptedModel, make_model: MakeModel, body: bytes
) -> None:
    scripted_model.expect(Reply.garbage(body))
    scripted_model.expect(Reply.text("fine now"))
    rig = build(make_model(bad_response_retries=1), {})

    finished = await rig.loop.run_turn(None, turn(), profile())

    assert finished.result.finish_reason == "stop"
    assert finished.result.content == "fine now"
    assert len(scripted_model.requests) == 2
    assert [m.content for m in rig.history()] == ["hello", "fine now"]


async def test_no_bad_response_retries(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(Reply.garbage())
    rig = build(make_model(bad_response_retries=0), {})

    finished = await rig.loop.run_turn(None, turn(), profile())

    assert finished.result.error is not None
    assert finished.result.error.code == "model_bad_response"
    assert len(scripted_model.requests) == 1


async def test_request_offers_tools_in_openai_format(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    admin_calls: list[dict[str, Any]] = []

    async def admin(args: dict[str, Any], ctx: ToolContext) -> Any:
        admin_calls.append(args)
        return "done"

    scripted_model.expect(Reply.tool_calls(call("admin", "a1")))
    scripted_model.expect(Reply.text("I cannot do that."))
    definitions = [
        ToolDefinition(
            name="lookup",
            description="Look an order up.",
            parameters={
                "type": "object",
                "properties": {"order_id": {"type": "string"}},
                "required": ["order_id"],
            },
        ),
        ToolDefinition(name="search", description="Search the help center."),
        ToolDefinition(name="admin", description="Not for this agent."),
    ]
    rig = build(
        make_model(), {"lookup": echo, "search": echo, "admin": admin}, definitions=definitions
    )
    agent = profile(
        model="support-model", temperature=0.3, max_tokens=256, tools=("lookup", "search")
    )

    finished = await rig.loop.run_turn(None, turn("where is my order?"), agent)

    assert finished.result.content == "I cannot do that."
    body = scripted_model.requests[0]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look an order up.",
                "parameters": {
                    "type": "object",
                    "properties": {"order_id": {"type": "string"}},
                    "required": ["order_id"],
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "search",
                "description": "Search the help center.",
                "parameters": {"type": "object", "properties": {}},
            },
        },
    ]
    assert body["messages"] == [
        {"role": "system", "content": PROMPT},
        {"role": "user", "content": "where is my order?"},
    ]
    assert (body["model"], body["temperature"], body["max_tokens"]) == ("support-model", 0.3, 256)
    # A tool the agent may not use is unknown to it, even though the catalog has it.
    assert "unknown tool" in error_of(tool_content(scripted_model.requests[1], "a1"))
    assert admin_calls == []
    assert scripted_model.requests[1]["tools"] == body["tools"]


# -- 10. resumption after a crash -----------------------------------------------------------


class Crash(Exception):
    """The worker died."""


class CrashingStore(MemoryStore):
    """A ``MemoryStore`` whose ``crash_on``-th save raises before writing anything (once)."""

    def __init__(self, crash_on: int) -> None:
        super().__init__()
        self.crash_on = crash_on
        self.saves = 0

    async def save(
        self,
        state: AgentState,
        *,
        append: Sequence[ChatMessage] = (),
        result: TurnResult | None = None,
        release: bool = False,
        step: StepExecution | None = None,
        cut_to: int | None = None,
    ) -> AgentState:
        self.saves += 1
        if self.saves == self.crash_on:
            raise Crash(f"worker died at save #{self.saves}")
        return await super().save(state, append=append, result=result, step=step, cut_to=cut_to)


# Saves of a turn with one step of two tool calls (the second call finishes first) and a final
# answer: 1 new turn, 2 input, 3 model answer, 4 "tickets" result, 5 the step (with the "orders"
# result, which completes it, and the tool messages), 6 final answer, 7 turn result.
@pytest.mark.parametrize(
    ("crash_on", "step0_requests", "step1_requests", "orders_calls", "tickets_calls"),
    [
        pytest.param(2, 1, 1, 1, 1, id="input-not-saved"),
        pytest.param(3, 2, 1, 1, 1, id="model-answer-not-saved"),
        pytest.param(4, 1, 1, 2, 2, id="no-tool-result-saved"),
        pytest.param(5, 1, 1, 2, 1, id="one-tool-result-saved"),
        pytest.param(6, 1, 2, 1, 1, id="final-answer-not-saved"),
        pytest.param(7, 1, 1, 1, 1, id="final-answer-saved"),
    ],
)
async def test_step_resumes_after_crash_without_redoing_saved_work(
    scripted_model: ScriptedModel,
    make_model: MakeModel,
    crash_on: int,
    step0_requests: int,
    step1_requests: int,
    orders_calls: int,
    tickets_calls: int,
) -> None:
    counts: Counter[str] = Counter()
    tickets_done = asyncio.Event()

    async def orders(args: dict[str, Any], ctx: ToolContext) -> Any:
        counts["orders"] += 1
        await tickets_done.wait()
        await asyncio.sleep(0.02)  # still running when the "tickets" result is saved
        return {"orders": ["o-1"]}

    async def tickets(args: dict[str, Any], ctx: ToolContext) -> Any:
        counts["tickets"] += 1
        await asyncio.sleep(0)
        tickets_done.set()
        return {"tickets": ["t-9"]}

    functions = {"orders": orders, "tickets": tickets}
    for _ in range(step0_requests):
        scripted_model.expect(Reply.tool_calls(call("orders", "call-o"), call("tickets", "call-t")))
    for _ in range(step1_requests):
        scripted_model.expect(Reply.text("You have one order and one ticket."))
    store = CrashingStore(crash_on)
    model = make_model()
    agent = profile()

    with pytest.raises(Crash):  # as itself, even from the concurrent tool phase
        await build(model, functions, store=store).loop.run_turn(None, turn(), agent)

    state = await store.load(SESSION)
    assert state is not None
    assert state.execution is not None
    resumed = build(model, functions, store=store)  # a fresh worker on the same store
    result = await finish(resumed.loop, state, agent)

    assert result.finish_reason == "stop"
    assert result.content == "You have one order and one ticket."
    assert result.steps == 2
    assert store.results[SESSION, "t1"] == result
    assert len(scripted_model.requests) == step0_requests + step1_requests
    assert counts == Counter(orders=orders_calls, tickets=tickets_calls)
    history = store.histories[SESSION]
    assert [(m.role, m.tool_call_id) for m in history] == [
        ("user", None),
        ("assistant", None),
        ("tool", "call-o"),
        ("tool", "call-t"),
        ("assistant", None),
    ]
    assert json.loads(history[2].content or "") == {"orders": ["o-1"]}
    assert json.loads(history[3].content or "") == {"tickets": ["t-9"]}
    assert_transcript(history)
    # Every request the model got (including a repeated one) showed a clean transcript.
    for body in scripted_model.requests:
        assert_transcript(body["messages"])
    assert [m["role"] for m in scripted_model.requests[-1]["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
    ]
    final = await store.load(SESSION)
    assert final is not None
    assert final.execution is None
    assert final.history_len == 5


async def test_lost_write_in_tool_phase_surfaces_as_stale_state(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    store = MemoryStore()

    async def lookup(args: dict[str, Any], ctx: ToolContext) -> Any:
        # Another worker writes the session while this tool runs.
        stored = store.states[SESSION]
        store.states[SESSION] = stored.model_copy(update={"version": stored.version + 1})
        return "ok"

    scripted_model.expect(Reply.tool_calls(call("lookup", "c1"), call("lookup", "c2")))
    rig = build(make_model(), {"lookup": lookup}, store=store)

    # Not wrapped in an ExceptionGroup: the worker must see a retryable error to requeue.
    with pytest.raises(StaleStateError):
        await rig.loop.run_turn(None, turn(), profile())
    assert issubclass(StaleStateError, RetryableError)


class VanishingCatalog(StaticCatalog):
    """Offers its tools to the model, then loses them (the service died) before dispatch."""

    def __init__(self, definitions: Sequence[ToolDefinition]) -> None:
        super().__init__(definitions)
        self.asked = 0

    async def available(self) -> Sequence[ToolDefinition]:
        self.asked += 1
        return self.definitions if self.asked == 1 else []


async def test_a_call_offered_to_the_model_is_sent_though_its_announcement_vanished(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    """An outage can hide a live service's announcement, and the call may have run already:
    it is sent as it was (its idempotency key), not answered from the catalog."""
    scripted_model.expect(
        Reply.tool_calls(call("lookup", "c1", result={"results": ["x"]}), call("invented", "c2"))
    )
    scripted_model.expect(Reply.text("Found x."))
    rig = build(make_model(), {"lookup": echo})
    rig.loop.catalog = VanishingCatalog([tool_def("lookup")])
    quiet = profile(LoopLimits(empty_streak_after=0))
    finished = await rig.loop.run_turn(None, turn(), quiet)
    assert finished.result.content == "Found x."
    assert json.loads(tool_content(scripted_model.requests[1], "c1")) == {"results": ["x"]}
    assert error_of(tool_content(scripted_model.requests[1], "c2")) == "unknown tool: 'invented'"
    assert [(c.call_id, c.context.idempotency_key) for c in rig.tools.calls] == [("c1", "t1:c1")]


async def test_a_call_whose_tool_is_bound_nowhere_is_unavailable_not_unknown(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    class Unbound(FunctionTools):
        async def call(self, request: Any, definition: ToolDefinition) -> Any:
            raise ToolUnavailableError(
                f"tool unavailable: no service is bound for {request.tool!r}"
            )

    scripted_model.expect(Reply.tool_calls(call("lookup", "c1", q="x")))
    scripted_model.expect(Reply.text("The lookup service is down."))
    rig = build(make_model(), {"lookup": echo})
    rig.loop.catalog = VanishingCatalog([tool_def("lookup")])
    rig.loop.tools.caller = Unbound({})
    finished = await rig.loop.run_turn(None, turn(), profile())
    assert finished.result.content == "The lookup service is down."
    assert error_of(tool_content(scripted_model.requests[1], "c1")).startswith("tool unavailable:")


async def test_reused_tool_call_ids_are_made_unique_within_the_turn(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    # a server that numbers calls from 0 in every response, and repeats an id in one response
    scripted_model.expect(Reply.tool_calls(call("lookup", "call_0", result={"results": ["a"]})))
    scripted_model.expect(
        Reply.tool_calls(
            call("lookup", "call_0", result={"results": ["b"]}),
            call("lookup", "call_0", result={"results": ["c"]}),
        )
    )
    scripted_model.expect(Reply.text("done"))
    rig = build(make_model(), {"lookup": echo})
    finished = await rig.loop.run_turn(None, turn(), profile())
    assert finished.result.content == "done"
    keys = [c.context.idempotency_key for c in rig.tools.calls]
    assert len(set(keys)) == 3, "each call has its own idempotency key"
    assert [c.arguments["result"]["results"] for c in rig.tools.calls] == [["a"], ["b"], ["c"]]
    assert_transcript(rig.history())
    last = scripted_model.requests[2]["messages"]
    tool_texts = [m["content"] for m in last if m["role"] == "tool"]
    assert [json.loads(t)["results"] for t in tool_texts] == [["a"], ["b"], ["c"]]


async def test_turn_past_its_deadline_is_cancelled_before_the_next_step(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(Reply.tool_calls(call("lookup", "c0"), content="working on it"))
    clock = [1000.0]
    rig = build(make_model(), {"lookup": echo})
    rig.loop.clock = lambda: clock[0]
    rig.loop.tools.clock = rig.loop.clock
    request = turn().model_copy(update={"deadline": 1005.0})
    state = await rig.store.save(new_execution(None, request, profile(), clock[0]))
    outcome = await rig.loop.step(state, profile())
    assert isinstance(outcome, RunAgain)
    clock[0] = 1010.0  # the deadline passes between steps
    finished = await rig.loop.step(outcome.state, profile())
    assert isinstance(finished, Finished)
    assert finished.result.finish_reason == "cancelled"
    assert finished.result.content == "working on it"
    assert len(scripted_model.requests) == 1
    assert_transcript(rig.history())


class CopyingStore(MemoryStore):
    """A store whose saves hand back a copy and that parks states as bytes: the loop's state
    objects are its own, as with the Redis store."""

    async def save(self, state: AgentState, **kwargs: Any) -> AgentState:
        return (await super().save(state, **kwargs)).model_copy()

    def park(self, state: AgentState) -> ParkedState:
        super().park(state)  # only a state as stored
        return ParkedState(encode_stored(state), state.version)


@pytest.mark.parametrize("steps_before", [0, 2])
async def test_while_the_model_thinks_the_loop_holds_no_state_objects(
    scripted_model: ScriptedModel, make_model: MakeModel, steps_before: int
) -> None:
    """Thousands of turns wait for the model at once: the state is kept as bytes meanwhile."""
    rig = build(make_model(), {"lookup": echo}, store=CopyingStore())
    agent = profile()
    held: list[int] = []

    def count_states(_request: dict[str, Any]) -> None:
        gc.collect()  # garbage is not held
        stored = {id(s) for s in rig.store.states.values()}
        held.append(
            sum(
                type(o) is AgentState
                and id(o) not in stored
                and o.execution is not None
                and o.execution.turn_id == "t-parked"
                for o in gc.get_objects()
            )
        )

    for n in range(steps_before):
        scripted_model.expect(Reply.tool_calls(call("lookup", f"c{n}", result=n)))
    scripted_model.expect(Reply.text("done"), check=count_states)
    state = await rig.store.save(new_execution(None, turn(turn_id="t-parked"), agent, time.time()))
    for _ in range(steps_before):
        outcome = await rig.loop.step(state, agent)
        assert isinstance(outcome, RunAgain)
        state = outcome.state
        del outcome
    stepping = rig.loop.step(state, agent)
    del state  # handed over, as the worker does
    finished = await stepping
    assert isinstance(finished, Finished)
    assert finished.result.content == "done"
    assert held == [0]
    assert_transcript(rig.history())


# -- answers cut short, step errors ----------------------------------------------------------


async def test_an_answer_cut_short_by_the_token_limit_ends_with_length(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(Reply.text("The order shipped on Mon", finish_reason="length"))
    rig = build(make_model(), {"lookup": echo})

    finished = await rig.loop.run_turn(None, turn(), profile())

    assert (finished.result.finish_reason, finished.result.content) == (
        "length",
        "The order shipped on Mon",
    )
    assert rig.sink.types() == ["turn.started", "step.completed", "turn.completed"]
    assert [m.content for m in rig.history()] == ["hello", "The order shipped on Mon"]


async def test_a_step_records_its_tool_errors_and_is_typed_by_them(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    scripted_model.expect(Reply.tool_calls(call("lookup", "c1", fail="no such order")))
    scripted_model.expect(Reply.tool_calls(call("lookup", "c2", result={"items": [1]})))
    scripted_model.expect(Reply.text("done"))
    rig = build(make_model(), {"lookup": echo})

    await rig.loop.run_turn(None, turn(), profile())

    completed = [e.data for e in rig.sink.events if isinstance(e.data, StepCompleted)]
    assert [c.step_type for c in completed] == ["error", "tool_execution", "final_response"]
    steps = [e for e in rig.sink.events if e.type == "step.completed"]
    assert len(steps) == 3


async def test_a_persist_false_turn_keeps_its_state_updates_to_itself(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    class Remembers:
        async def call(self, request: Any, definition: ToolDefinition) -> Any:
            return ToolCallReply(
                call_id=request.call_id, status="ok", value="noted", state_updates={"tier": "gold"}
            )

    scripted_model.expect(Reply.text("Hi."))
    scripted_model.expect(Reply.tool_calls(call("lookup", "k1")))
    scripted_model.expect(Reply.text("noted for now"))
    rig = build(make_model(), {"lookup": echo})
    rig.loop.tools.caller = Remembers()
    await rig.loop.run_turn(None, turn("hello"), profile())
    state = await rig.store.load(SESSION)
    assert state is not None

    finished = await rig.loop.run_turn(state, turn("x", turn_id="t2", persist=False), profile())

    after = await rig.store.load(SESSION)
    assert finished.result.content == "noted for now"
    assert after is not None
    assert after.context.kv == state.context.kv == {}
    assert after.execution_count == state.execution_count == 1
    assert after.history_len == state.history_len


async def test_tool_invoking_counts_the_rounds_a_call_was_really_sent_in(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    class LosesTheFirstReply(FunctionTools):
        async def call(self, request: Any, definition: ToolDefinition) -> Any:
            reply = await super().call(request, definition)
            if len(self.calls) == 1:
                raise RetryableError("the reply was lost with the broker connection")
            return reply

    scripted_model.expect(Reply.tool_calls(call("lookup", "c1", result={"results": [1]})))
    scripted_model.expect(Reply.text("done"))
    rig = build(make_model(), {"lookup": echo})
    rig.loop.tools.caller = tools = LosesTheFirstReply({"lookup": echo})
    agent = profile()
    state = await rig.store.save(new_execution(None, turn(), agent, time.time()))
    with pytest.raises(RetryableError):
        await rig.loop.step(state, agent)  # the model's answer is saved, the call's reply lost
    saved = await rig.store.load(SESSION)
    assert saved is not None
    redone = await rig.loop.step(saved, agent)
    assert isinstance(redone, RunAgain)
    invoking = [e for e in rig.sink.events if e.type == "tool.invoking"]
    assert [(e.data.attempt, e.data.call_id) for e in invoking] == [(1, "c1"), (2, "c1")]  # type: ignore[union-attr]
    assert invoking[0].id != invoking[1].id, "a real second dispatch is another event"
    assert [c.context.idempotency_key for c in tools.calls] == ["t1:c1", "t1:c1"]
    finished = await rig.loop.step(redone.state, agent)
    assert isinstance(finished, Finished)


async def test_a_turn_ending_with_an_error_ends_even_when_an_after_execution_hook_fails(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    class Fails(Hook):
        async def after_execution(self, ctx: HookContext, result: TurnResult) -> None:
            raise RuntimeError("the hook's own store is down")

    scripted_model.expect(Reply.error(500, "boom"))
    rig = build(make_model(max_retries=0), {"lookup": echo}, hooks=Fails())
    finished = await rig.loop.run_turn(None, turn(), profile())
    assert finished.result.finish_reason == "error"
    assert rig.store.results[SESSION, "t1"] == finished.result
    assert rig.sink.types()[-1] == "turn.failed"


async def test_a_turn_ended_while_its_tool_calls_were_out_keeps_the_history_well_formed(
    scripted_model: ScriptedModel, make_model: MakeModel
) -> None:
    class Lost(FunctionTools):
        async def call(self, request: Any, definition: ToolDefinition) -> Any:
            if request.call_id == "c2":
                raise RetryableError("the reply was lost")
            return await super().call(request, definition)

    scripted_model.expect(
        Reply.tool_calls(call("lookup", "c1", result={"results": [1]}), call("lookup", "c2"))
    )
    rig = build(make_model(), {"lookup": echo})
    rig.loop.tools.caller = Lost({"lookup": echo})
    agent = profile()
    state = await rig.store.save(new_execution(None, turn(), agent, time.time()))
    with pytest.raises(RetryableError):
        await rig.loop.step(state, agent)  # c1's result saved, c2 out when the step failed
    saved = await rig.store.load(SESSION)
    assert saved is not None
    error = TurnError(code="step_failed", message="it keeps failing")
    finished = await rig.loop.end(saved, agent, "error", None, error=error)
    assert finished.result.finish_reason == "error"
    assert_transcript(rig.history())
    tools = {m.tool_call_id: m.content for m in rig.history() if m.role == "tool"}
    assert json.loads(tools["c1"]) == {"results": [1]}
    assert json.loads(tools["c2"]) == {"error": "not run: the turn ended (error)"}
