"""Tool RPC failures are told apart: a call that never left is redone, not the tool's error."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest
from aio_pika.abc import AbstractChannel
from aiormq.exceptions import ChannelInvalidStateError, ConnectionClosed

from contracts.codec import encode
from contracts.tools import ToolCallReply, ToolCallRequest, ToolContext, ToolDefinition
from worker.errors import RetryableError, ToolCallError
from worker.transport.rpc import ToolRPC


class _Down:
    """A publisher and a reply queue whose connection is gone."""

    name = "loopwire.replies.test"

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def publish(self, *_args: Any, **_kwargs: Any) -> None:
        raise self.error


def _request() -> ToolCallRequest:
    return ToolCallRequest(
        call_id="call_1",
        tool="lookup",
        arguments={"q": "x"},
        context=ToolContext(
            session_id="s1",
            turn_id="t1",
            agent="support",
            deadline=time.time() + 30,
            idempotency_key="t1:call_1",
        ),
    )


@pytest.mark.parametrize(
    "error",
    [
        ChannelInvalidStateError("channel closed"),
        ConnectionClosed(320, "CONNECTION_FORCED"),
        ConnectionResetError("reset"),
    ],
)
async def test_a_call_that_could_not_be_sent_is_retryable(error: Exception) -> None:
    rpc = ToolRPC(cast(AbstractChannel, None))
    down = _Down(error)
    rpc.publisher = cast(Any, down)
    rpc.queue = cast(Any, down)
    definition = ToolDefinition(name="lookup", description="d", parameters={"type": "object"})
    with pytest.raises(RetryableError, match="could not send the tool call"):
        await rpc.call(_request(), definition)
    assert rpc.futures == {}


class _Sent:
    """A publisher that keeps what it sent, and a reply queue's name."""

    name = "loopwire.replies.test"

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def publish(self, body: bytes, **kwargs: Any) -> None:
        self.sent.append(kwargs["properties"])


class _Reply:
    """A reply as the reply queue delivers it."""

    def __init__(self, body: bytes, *, key: str | None, correlation_id: str) -> None:
        self.body = body
        self.headers = {} if key is None else {"idempotency-key": key}
        self.correlation_id = correlation_id


def _rpc() -> tuple[ToolRPC, _Sent]:
    rpc = ToolRPC(cast(AbstractChannel, None))
    sent = _Sent()
    rpc.publisher = cast(Any, sent)
    rpc.queue = cast(Any, sent)
    return rpc, sent


DEFINITION = ToolDefinition(name="lookup", description="d", parameters={"type": "object"})


async def _started(rpc: ToolRPC, sent: _Sent, count: int) -> list[asyncio.Task[Any]]:
    tasks = [asyncio.create_task(rpc.call(_request(), DEFINITION)) for _ in range(count)]
    for _ in range(100):  # each call publishes, then waits for its reply
        if len(sent.sent) == count:
            return tasks
        await asyncio.sleep(0)
    raise AssertionError("the calls were not published")


async def test_a_newer_call_with_the_same_key_keeps_its_future_when_the_older_one_ends() -> None:
    rpc, sent = _rpc()
    older, newer = await _started(rpc, sent, 2)
    older.cancel()  # e.g. its step was abandoned
    with pytest.raises(asyncio.CancelledError):
        await older
    reply = encode(ToolCallReply(call_id="call_1", status="ok", value=7))
    await rpc._on_reply(cast(Any, _Reply(reply, key="t1:call_1", correlation_id="call_1")))
    assert (await newer).value == 7
    assert rpc.futures == {}


async def test_one_reply_answers_every_call_waiting_on_its_key() -> None:
    rpc, sent = _rpc()
    first, second = await _started(rpc, sent, 2)
    reply = encode(ToolCallReply(call_id="call_1", status="ok", value="same"))
    await rpc._on_reply(cast(Any, _Reply(reply, key="t1:call_1", correlation_id="call_1")))
    assert [(await first).value, (await second).value] == ["same", "same"]


async def test_a_reply_without_the_key_header_is_matched_by_its_correlation_id() -> None:
    rpc, sent = _rpc()
    (call,) = await _started(rpc, sent, 1)
    other = encode(ToolCallReply(call_id="call_9", status="ok", value="not mine"))
    await rpc._on_reply(cast(Any, _Reply(other, key=None, correlation_id="call_9")))
    assert not call.done()
    reply = encode(ToolCallReply(call_id="call_1", status="ok", value="mine"))
    await rpc._on_reply(cast(Any, _Reply(reply, key=None, correlation_id="call_1")))
    assert (await call).value == "mine"


async def test_an_undecodable_reply_fails_the_call_as_a_tool_error() -> None:
    rpc, sent = _rpc()
    (call,) = await _started(rpc, sent, 1)
    await rpc._on_reply(cast(Any, _Reply(b"\xc1", key="t1:call_1", correlation_id="call_1")))
    with pytest.raises(ToolCallError, match="invalid reply"):
        await call
