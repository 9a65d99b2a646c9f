"""Tool RPC failures are told apart: a call that never left is redone, not the tool's error."""

from __future__ import annotations

import time
from typing import Any, cast

import pytest
from aio_pika.abc import AbstractChannel
from aiormq.exceptions import ChannelInvalidStateError, ConnectionClosed

from contracts.tools import ToolCallRequest, ToolContext, ToolDefinition
from worker.errors import RetryableError
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
