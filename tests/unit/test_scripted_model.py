"""Tests for the scripted OpenAI-compatible server, through the real openai client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageFunctionToolCall

from worker.testing.scripted_model import Reply, ScriptedModel

USER_HI: list[Any] = [{"role": "user", "content": "hi"}]


def function_calls(result: ChatCompletion) -> list[ChatCompletionMessageFunctionToolCall]:
    calls = result.choices[0].message.tool_calls
    assert calls is not None
    assert all(isinstance(call, ChatCompletionMessageFunctionToolCall) for call in calls)
    return [call for call in calls if isinstance(call, ChatCompletionMessageFunctionToolCall)]


def make_client(server: ScriptedModel, max_retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=max_retries)


@pytest.fixture
async def client(scripted_model: ScriptedModel) -> AsyncIterator[openai.AsyncOpenAI]:
    api = make_client(scripted_model)
    try:
        yield api
    finally:
        await api.close()


@pytest.fixture
async def bare_server() -> AsyncIterator[ScriptedModel]:
    """A server without the assert_done teardown, for tests that leave failures on purpose."""
    server = ScriptedModel()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_text_answer(scripted_model: ScriptedModel, client: openai.AsyncOpenAI) -> None:
    scripted_model.expect(Reply.text("hello there"))
    result = await client.chat.completions.create(model="gpt-test", messages=USER_HI)
    choice = result.choices[0]
    assert choice.message.content == "hello there"
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert choice.message.tool_calls is None
    assert result.model == "gpt-test"
    assert result.object == "chat.completion"
    assert result.id.startswith("chatcmpl-")
    assert result.usage is not None
    assert result.usage.prompt_tokens == 1
    assert result.usage.completion_tokens == max(1, len("hello there") // 4)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    assert scripted_model.requests[0]["messages"] == USER_HI
    assert scripted_model.pending == 0


async def test_explicit_usage(scripted_model: ScriptedModel, client: openai.AsyncOpenAI) -> None:
    scripted_model.expect(Reply.text("ok", usage=(120, 7)))
    result = await client.chat.completions.create(model="m", messages=USER_HI)
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (120, 7)
    assert result.usage.total_tokens == 127


async def test_single_tool_call(scripted_model: ScriptedModel, client: openai.AsyncOpenAI) -> None:
    args: dict[str, object] = {"query": "weather in Oslo", "limit": 3, "tags": ["a", "b"]}
    scripted_model.expect(Reply.tool_calls(("search", args)))
    result = await client.chat.completions.create(model="m", messages=USER_HI)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = function_calls(result)
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "function"
    assert call.function.name == "search"
    assert json.loads(call.function.arguments) == args
    assert call.id.startswith("call_")


async def test_parallel_tool_calls(
    scripted_model: ScriptedModel, client: openai.AsyncOpenAI
) -> None:
    scripted_model.expect(
        Reply.tool_calls(
            ("add", {"a": 1, "b": 2}),
            ("mul", {"a": 3, "b": 4}),
            content="calling two tools",
        )
    )
    scripted_model.expect(Reply.tool_calls(("add", {"a": 5, "b": 6}), ("noop", {}, "my-id")))
    first = await client.chat.completions.create(model="m", messages=USER_HI)
    second = await client.chat.completions.create(model="m", messages=USER_HI)
    first_calls = function_calls(first)
    second_calls = function_calls(second)
    assert first.choices[0].message.content == "calling two tools"
    assert [c.function.name for c in first_calls] == ["add", "mul"]
    assert [json.loads(c.function.arguments) for c in first_calls] == [
        {"a": 1, "b": 2},
        {"a": 3, "b": 4},
    ]
    assert second_calls[1].id == "my-id"
    ids = [c.id for c in first_calls] + [second_calls[0].id]
    assert len(set(ids)) == 3


async def test_raw_tool_call_is_verbatim(
    scripted_model: ScriptedModel, client: openai.AsyncOpenAI
) -> None:
    scripted_model.expect(Reply.raw_tool_call("search", '{"query": ', call_id="broken-1"))
    result = await client.chat.completions.create(model="m", messages=USER_HI)
    calls = function_calls(result)
    assert calls[0].id == "broken-1"
    assert calls[0].function.arguments == '{"query": '
    assert result.choices[0].finish_reason == "tool_calls"


async def test_429_then_text_is_retried(scripted_model: ScriptedModel) -> None:
    scripted_model.expect(Reply.error(429, "slow down", headers={"retry-after-ms": "1"}))
    scripted_model.expect(Reply.text("after retry"))
    api = make_client(scripted_model, max_retries=2)
    try:
        result = await api.chat.completions.create(model="m", messages=USER_HI)
    finally:
        await api.close()
    assert result.choices[0].message.content == "after retry"
    assert len(scripted_model.requests) == 2


async def test_429_without_retries_raises_rate_limit(
    scripted_model: ScriptedModel, client: openai.AsyncOpenAI
) -> None:
    scripted_model.expect(Reply.error(429, "slow down"))
    with pytest.raises(openai.RateLimitError) as info:
        await client.chat.completions.create(model="m", messages=USER_HI)
    assert info.value.status_code == 429
    assert "slow down" in info.value.message


async def test_500_without_retries_raises(
    scripted_model: ScriptedModel, client: openai.AsyncOpenAI
) -> None:
    scripted_model.expect(Reply.error(500, "boom"))
    with pytest.raises(openai.InternalServerError) as info:
        await client.chat.completions.create(model="m", messages=USER_HI)
    assert info.value.status_code == 500
    assert isinstance(info.value.body, dict)
    assert info.value.body["message"] == "boom"


async def test_garbage_body_raises_json_decode_error(
    scripted_model: ScriptedModel, client: openai.AsyncOpenAI
) -> None:
    # openai 3.x does not wrap this: the json module's error escapes as is.
    scripted_model.expect(Reply.garbage())
    with pytest.raises(json.JSONDecodeError):
        await client.chat.completions.create(model="m", messages=USER_HI)


async def test_unexpected_call_is_recorded(bare_server: ScriptedModel) -> None:
    api = make_client(bare_server)
    try:
        with pytest.raises(openai.InternalServerError):
            await api.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "who is there?"}]
            )
    finally:
        await api.close()
    assert len(bare_server.failures) == 1
    assert bare_server.failures[0].startswith("unexpected call #1: ")
    assert "who is there?" in bare_server.failures[0]
    with pytest.raises(AssertionError, match="unexpected call #1"):
        bare_server.assert_done()


async def test_unexpected_call_retries_are_each_recorded(bare_server: ScriptedModel) -> None:
    api = openai.AsyncOpenAI(base_url=bare_server.base_url, api_key="test", max_retries=1)
    try:
        with pytest.raises(openai.InternalServerError):
            await api.with_options(timeout=5).chat.completions.create(model="m", messages=USER_HI)
    finally:
        await api.close()
    assert [f.split(":")[0] for f in bare_server.failures] == [
        "unexpected call #1",
        "unexpected call #2",
    ]


async def test_unconsumed_expectation_fails_assert_done(bare_server: ScriptedModel) -> None:
    bare_server.expect(Reply.text("never asked for"))
    bare_server.expect(Reply.tool_calls(("search", {"q": 1})))
    assert bare_server.pending == 2
    with pytest.raises(AssertionError, match="unconsumed expectation") as info:
        bare_server.assert_done()
    assert "never asked for" in str(info.value)
    assert "search" in str(info.value)


async def test_check_failure_is_recorded(bare_server: ScriptedModel) -> None:
    def must_offer_tools(body: dict[str, Any]) -> None:
        assert "tools" in body, "request offered no tools"

    bare_server.expect(Reply.text("fine"), check=must_offer_tools)
    api = make_client(bare_server)
    try:
        result = await api.chat.completions.create(model="m", messages=USER_HI)
    finally:
        await api.close()
    assert result.choices[0].message.content == "fine"
    assert len(bare_server.failures) == 1
    assert "request offered no tools" in bare_server.failures[0]
    with pytest.raises(AssertionError, match="check failed for call #1"):
        bare_server.assert_done()


async def test_passing_check_sees_request(
    scripted_model: ScriptedModel, client: openai.AsyncOpenAI
) -> None:
    seen: list[dict[str, Any]] = []
    scripted_model.expect(Reply.text("ok"), check=seen.append)
    await client.chat.completions.create(model="m", messages=USER_HI, temperature=0.25)
    assert seen[0]["temperature"] == 0.25


async def test_respond_with_answers_from_request(
    scripted_model: ScriptedModel, client: openai.AsyncOpenAI
) -> None:
    async def responder(body: dict[str, Any]) -> Reply:
        last = body["messages"][-1]["content"]
        return Reply.text(f"answer to {last}", delay=0.05)

    scripted_model.respond_with(responder)
    questions = [f"q{i}" for i in range(20)]
    results = await asyncio.gather(
        *(
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}])
            for q in questions
        )
    )
    assert [r.choices[0].message.content for r in results] == [f"answer to {q}" for q in questions]

    scripted_model.respond_with(lambda body: Reply.text("sync responder"))
    scripted_model.expect(Reply.text("queued first"))
    first = await client.chat.completions.create(model="m", messages=USER_HI)
    second = await client.chat.completions.create(model="m", messages=USER_HI)
    assert first.choices[0].message.content == "queued first"
    assert second.choices[0].message.content == "sync responder"
    scripted_model.respond_with(None)


async def test_wait_for_requests(scripted_model: ScriptedModel, client: openai.AsyncOpenAI) -> None:
    scripted_model.expect(Reply.text("one", delay=0.2))
    scripted_model.expect(Reply.text("two", delay=0.2))
    calls = [
        asyncio.create_task(client.chat.completions.create(model="m", messages=USER_HI))
        for _ in range(2)
    ]
    await scripted_model.wait_for_requests(2, timeout=5)
    assert len(scripted_model.requests) == 2
    assert not any(task.done() for task in calls)
    results = await asyncio.gather(*calls)
    assert sorted(r.choices[0].message.content or "" for r in results) == ["one", "two"]
    await scripted_model.wait_for_requests(1)


async def test_wait_for_requests_times_out(scripted_model: ScriptedModel) -> None:
    with pytest.raises(AssertionError, match="0 of 1 requests"):
        await scripted_model.wait_for_requests(1, timeout=0.05)


async def test_models_and_health_endpoints(
    scripted_model: ScriptedModel, client: openai.AsyncOpenAI
) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["scripted-model"]
    async with (
        aiohttp.ClientSession() as session,
        session.get(scripted_model.base_url.removesuffix("/v1") + "/healthz") as response,
    ):
        assert response.status == 200
        assert await response.text() == "ok"


async def test_non_json_request_is_rejected(bare_server: ScriptedModel) -> None:
    url = bare_server.base_url + "/chat/completions"
    async with aiohttp.ClientSession() as session, session.post(url, data=b"nope") as response:
        assert response.status == 400
        body = await response.json()
    assert "error" in body
    assert bare_server.requests == []
    assert len(bare_server.failures) == 1


async def test_model_defaults_to_server_model(scripted_model: ScriptedModel) -> None:
    scripted_model.expect(Reply.text("no model given"))
    url = scripted_model.base_url + "/chat/completions"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json={"messages": USER_HI}) as response,
    ):
        assert response.status == 200
        body = await response.json()
    assert body["model"] == "scripted-model"
    assert body["choices"][0]["logprobs"] is None
