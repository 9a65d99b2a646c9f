"""The context budget over the sequencer and a ``MemoryStore``: 300 turns with ``window`` and
with ``summarize`` stay under the budget, never split a tool call from its results, make each
summary once and show it to the model; a request the model finds too long is trimmed once."""

from __future__ import annotations

import json
from typing import Any

import pytest

from contracts.messages import ChatMessage, ToolCall, Usage
from contracts.state import ModelResponse
from contracts.tools import ToolContext
from tests.unit.world import World, request, world
from worker.errors import ModelError
from worker.loop.context import SUMMARY_PROMPT, estimate
from worker.loop.ports import ModelRequest

BUDGET = 1200


def tokens(request: ModelRequest) -> int:
    """The size of a request as a tokenizer would count it, roughly (4 characters a token)."""
    size = 0
    for m in request.messages:
        size += len(m.content or "") // 4 + 4
        size += sum(len(c.name) + len(c.arguments) for c in m.tool_calls) // 4
    return size


def answered(request: ModelRequest, message: ChatMessage) -> ModelResponse:
    usage = Usage(
        prompt_tokens=tokens(request), completion_tokens=20, total_tokens=tokens(request) + 20
    )
    return ModelResponse(
        message=message,
        usage=usage,
        finish_reason="tool_calls" if message.tool_calls else "stop",
    )


def agent_answer(request: ModelRequest) -> ModelResponse:
    """Each turn: one lookup, then an answer of some length."""
    last = request.messages[-1]
    if last.role == "user":
        n = (last.content or "").split()[-1]
        call = ToolCall(id=f"call_{n}", name="lookup", arguments=json.dumps({"q": n}))
        return answered(request, ChatMessage(role="assistant", tool_calls=(call,)))
    return answered(request, ChatMessage(role="assistant", content="answer " + "x" * 300))


async def lookup(args: dict[str, Any], ctx: ToolContext) -> Any:
    return {"found": "y" * 400, "q": args["q"]}


def summarizer(calls: list[ModelRequest]) -> Any:
    def answer(request: ModelRequest) -> ModelResponse:
        calls.append(request)
        message = ChatMessage(role="assistant", content=f"SUMMARY {len(calls)}")
        return answered(request, message)

    return answer


def check_requests(w: World, budget: int) -> None:
    for agent, asked in w.model.requests:
        if agent != "a":
            continue
        assert tokens(asked) <= budget, f"a request of {tokens(asked)} tokens"
        assert asked.messages[0].role == "system" and asked.messages[0].content == "agent:a"
        answered_ids = {m.tool_call_id for m in asked.messages if m.role == "tool"}
        called = {c.id for m in asked.messages for c in m.tool_calls}
        assert answered_ids <= called, "a tool result was sent without its call"
        assert called <= answered_ids, "a tool call was sent without its result"


async def run_turns(w: World, count: int) -> None:
    for i in range(count):
        await w.run(request("a", f"question {i}", turn_id=f"T{i}"))
        assert w.result(f"T{i}").finish_reason == "stop"


@pytest.mark.parametrize("strategy", ["window", "summarize"])
async def test_300_turns_stay_under_the_budget(strategy: str) -> None:
    summaries: list[ModelRequest] = []
    profile = {
        "name": "a",
        "limits": {"empty_streak_after": 0},
        "context": {"max_tokens": BUDGET, "strategy": strategy, "keep_last": 4},
    }
    w = world(
        {"agents": [profile]},
        {"a": agent_answer, SUMMARY_PROMPT: summarizer(summaries)},
        tools={"lookup": lookup},
    )
    await run_turns(w, 300)
    check_requests(w, BUDGET)
    history = w.store.histories["S1"]
    assert len(history) == 300 * 4, "the history itself is kept whole"
    steps = [e.data for e in w.events.events if e.type == "step.completed"]
    assert all(s.input_tokens_estimate is not None for s in steps)  # type: ignore[union-attr]
    last = w.model.requests[-1][1]
    if strategy == "window":
        assert not summaries
        assert not any(s.summarized for s in steps)  # type: ignore[union-attr]
        return
    # summaries were made as the history grew, each folding the one before into it
    assert len(summaries) > 5
    for index, asked in enumerate(summaries[1:], start=1):
        assert f"(summary so far) SUMMARY {index}" in (asked.messages[-1].content or "")
    assert (
        last.messages[1].content
        == f"Summary of the earlier conversation:\nSUMMARY {len(summaries)}"
    )
    assert any(s.summarized for s in steps)  # type: ignore[union-attr]
    # the summary calls count in the turns' usage
    spent = sum(w.result(f"T{i}").usage.total_tokens for i in range(300))
    main = sum(tokens(r) + 20 for a, r in w.model.requests if a == "a")
    assert spent == main + sum(tokens(r) + 20 for r in summaries)


async def test_a_summary_is_made_once_when_the_step_is_redone() -> None:
    summaries: list[ModelRequest] = []
    failed = []

    def flaky(request: ModelRequest) -> ModelResponse:
        if summaries and not failed:
            failed.append(True)
            raise RuntimeError("the worker died here")
        return agent_answer(request)

    profile = {
        "name": "a",
        "limits": {"empty_streak_after": 0},
        "context": {"max_tokens": BUDGET, "strategy": "summarize", "keep_last": 4},
    }
    w = world(
        {"agents": [profile]},
        {"a": flaky, SUMMARY_PROMPT: summarizer(summaries)},
        tools={"lookup": lookup},
    )
    with pytest.raises(RuntimeError):
        await run_turns(w, 40)
    made = len(summaries)
    assert made == 1
    # the step is redone (as the redelivered message would): the saved summary is used
    failing = next(a for a in reversed(w.published) if type(a).__name__ == "Step")
    await w.drive([failing])
    assert len(summaries) == made
    asked = w.model.requests[-1][1]
    assert any((m.content or "").startswith("Summary of the earlier") for m in asked.messages)


async def test_a_request_the_model_finds_too_long_is_trimmed_once() -> None:
    refused: list[int] = []

    def picky(request: ModelRequest) -> ModelResponse:
        if not refused and len(request.messages) > 20:
            refused.append(len(request.messages))
            raise ModelError(
                "model endpoint answered 400: This model's maximum context length is 8192",
                code="model_http_400",
            )
        return agent_answer(request)

    w = world(
        {"agents": [{"name": "a", "limits": {"empty_streak_after": 0}}]},
        {"a": picky},
        tools={"lookup": lookup},
    )
    await run_turns(w, 8)
    assert refused, "the model never refused"
    sizes = [len(r.messages) for a, r in w.model.requests]
    after = sizes[sizes.index(refused[0]) + 1]
    assert after < refused[0]


def documented(request: ModelRequest) -> int:
    """A request's size by the documented estimate (``worker.loop.context.estimate``)."""
    return sum(estimate(m.model_dump(mode="json", exclude_none=True)) for m in request.messages)


def as_documented(request: ModelRequest, message: ChatMessage) -> ModelResponse:
    """An answer whose ``prompt_tokens`` is the documented estimate of what it was sent."""
    size = documented(request)
    usage = Usage(prompt_tokens=size, completion_tokens=20, total_tokens=size + 20)
    reason = "tool_calls" if message.tool_calls else "stop"
    return ModelResponse(message=message, usage=usage, finish_reason=reason)


@pytest.mark.parametrize("summary_chars", [400, 1600])
async def test_the_budget_and_the_reported_estimate_count_a_new_summary(
    summary_chars: int,
) -> None:
    budget = 800

    def agent(request: ModelRequest) -> ModelResponse:
        return as_documented(request, agent_answer(request).message)

    def summarize(request: ModelRequest) -> ModelResponse:
        text = "a summary of the conversation " * (summary_chars // 30)
        return as_documented(request, ChatMessage(role="assistant", content=text))

    profile = {
        "name": "a",
        "limits": {"empty_streak_after": 0},
        "context": {"max_tokens": budget, "strategy": "summarize", "keep_last": 4},
    }
    w = world(
        {"agents": [profile]},
        {"a": agent, SUMMARY_PROMPT: summarize},
        tools={"lookup": lookup},
    )
    await run_turns(w, 30)

    sent = [r for a, r in w.model.requests if a == "a"]
    steps = [e.data for e in w.events.events if e.type == "step.completed"]
    assert any(s.summarized for s in steps)  # type: ignore[union-attr]
    assert len(sent) == len(steps)
    for request_sent, step in zip(sent, steps, strict=True):
        assert documented(request_sent) <= budget
        assert step.input_tokens_estimate == documented(request_sent)  # type: ignore[union-attr]


async def test_a_persist_false_turn_leaves_the_sessions_summary_and_token_ratio() -> None:
    summaries: list[ModelRequest] = []

    def agent(request: ModelRequest) -> ModelResponse:
        answer = agent_answer(request)
        user = next(m.content or "" for m in reversed(request.messages) if m.role == "user")
        if not user.startswith("an aside"):
            return answer
        usage = Usage(prompt_tokens=2 * tokens(request), completion_tokens=20)
        return answer.model_copy(update={"usage": usage})  # another model's tokenizer

    profile = {
        "name": "a",
        "limits": {"empty_streak_after": 0},
        "context": {"max_tokens": BUDGET, "strategy": "summarize", "keep_last": 4},
    }
    w = world(
        {"agents": [profile]},
        {"a": agent, SUMMARY_PROMPT: summarizer(summaries)},
        tools={"lookup": lookup},
    )
    await run_turns(w, 12)
    before = w.store.states["S1"]
    assert before.summary is not None and before.token_ratio is not None
    made = len(summaries)

    for i in range(3):
        text = "an aside " + "z" * 2400
        await w.run(request("a", f"{text} {i}", turn_id=f"X{i}", persist=False))
        assert w.result(f"X{i}").finish_reason == "stop"

    after = w.store.states["S1"]
    assert (after.summary, after.token_ratio) == (before.summary, before.token_ratio)
    assert len(summaries) == made
    assert after.history_len == before.history_len
    check_requests(w, BUDGET)
    # its requests still carry the session's summary, before what its cut left
    asides = [r for a, r in w.model.requests if a == "a"][-6:]
    assert before.summary is not None
    shown = f"Summary of the earlier conversation:\n{before.summary.text}"
    assert all(r.messages[1].content == shown for r in asides)
