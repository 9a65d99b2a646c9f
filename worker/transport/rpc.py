"""Tool calls as RPC messages over RabbitMQ (the worker's side).

A call is published on ``loopwire.tools`` with the tool's name as routing key,
``mandatory`` on a confirming channel (an unbound tool is returned at once
instead of waiting for its timeout), ``correlation_id`` = the tool call id,
``reply_to`` = this worker's exclusive reply queue, ``expiration`` from the
deadline and an ``idempotency-key`` header (``<turn_id>:<tool_call_id>``) that
tool services use to answer a repeated call from their stored reply.

Each call waits on a future of its own, keyed by a per-call number. A reply is
matched through the idempotency key it echoes (or, from a service that does not
echo it, its correlation id) to every call waiting on that key — a step redone
while its first attempt still waits sends the call again under the same key, and
both get the one stored reply — without scanning the calls in flight; a call's
cleanup removes only its own future. A lost reply times out.

On a RabbitMQ cluster the reply queue stays exclusive and auto-deleted (a classic queue on
the node of this worker's connection, declared again on the next node after a failover):
it belongs to one connection, which a quorum queue cannot. Replies lost with it are
recovered by the idempotency key (``contracts/runtime/amqp.py``, docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue
from aio_pika.exceptions import AMQPError, DeliveryError, PublishError
from aiormq.exceptions import ChannelInvalidStateError

from contracts.codec import DecodeError, decode, encode
from contracts.runtime.tracing import inject
from contracts.tools import ToolCallReply, ToolCallRequest, ToolDefinition
from contracts.topology import CONTENT_TYPE, H_IDEMPOTENCY_KEY, TOOLS_EXCHANGE
from worker.errors import RetryableError, ToolCallError, ToolUnavailableError
from worker.runtime import failpoints
from worker.transport.publish import ConfirmedPublisher, properties

log = logging.getLogger("loopwire.rpc")


class ToolRPC:
    """``ToolCaller`` over RabbitMQ. ``start()`` before use; one per worker process."""

    def __init__(
        self,
        channel: AbstractChannel,
        *,
        in_progress: Callable[[str], AbstractContextManager[object]] | None = None,
        traced: bool = False,
    ) -> None:
        self.channel = channel
        self.traced = traced
        """Each call carries the span current when it is sent (W3C ``traceparent``)."""
        self.in_progress = in_progress or (lambda _tool: contextlib.nullcontext())
        """Wraps each call from publish to reply (the worker counts calls in progress with it)."""
        self.futures: dict[int, asyncio.Future[ToolCallReply]] = {}
        """Every call waiting for its reply, by call number."""
        self._by_key: dict[str, set[int]] = {}
        self._by_correlation: dict[str, set[int]] = {}
        self._numbers = itertools.count()
        self.publisher: ConfirmedPublisher | None = None
        self.queue: AbstractQueue | None = None

    async def start(self) -> None:
        await self.channel.declare_exchange(
            TOOLS_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
        )
        self.publisher = ConfirmedPublisher(self.channel, TOOLS_EXCHANGE)
        # A named queue (not server-named): a robust connection re-declares it after a reconnect.
        name = f"loopwire.replies.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self.queue = await self.channel.declare_queue(name, exclusive=True, auto_delete=True)
        await self.queue.consume(self._on_reply, no_ack=True)
        self.channel.close_callbacks.add(self._on_channel_closed)

    def _on_channel_closed(self, *_: object) -> None:
        """The reply queue is exclusive: replies sent while the connection is down are lost.
        Calls waiting for one are failed as retryable, so their step is redone and each call
        re-sent with its idempotency key (the tool service answers from its stored reply)."""
        for future in self.futures.values():
            if not future.done():
                future.set_exception(
                    RetryableError("the broker connection was lost during a tool call")
                )

    def _headers(self, key: str) -> dict[str, Any]:
        headers: dict[str, Any] = {H_IDEMPOTENCY_KEY: key}
        if self.traced:  # the call's span goes with it (the tool service's is its child)
            inject(headers)
        return headers

    async def call(self, request: ToolCallRequest, definition: ToolDefinition) -> ToolCallReply:
        if self.publisher is None or self.queue is None:
            raise RuntimeError("ToolRPC.start() was not awaited")
        key = request.context.idempotency_key
        expiration_ms = max(1, int((request.context.deadline - time.time()) * 1000))
        body = encode(request)
        props = properties(
            content_type=CONTENT_TYPE,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            headers=self._headers(key),
            message_id=f"{key}:{uuid.uuid4().hex[:8]}",
            correlation_id=request.call_id,
            reply_to=self.queue.name,
            expiration_ms=expiration_ms,
        )
        future: asyncio.Future[ToolCallReply] = asyncio.get_running_loop().create_future()
        number = next(self._numbers)
        self.futures[number] = future
        self._by_key.setdefault(key, set()).add(number)
        self._by_correlation.setdefault(request.call_id, set()).add(number)
        try:
            with self.in_progress(request.tool):
                try:
                    await self.publisher.publish(
                        body, routing_key=request.tool, properties=props, mandatory=True
                    )
                except PublishError as exc:
                    raise ToolUnavailableError(
                        f"tool unavailable: no service is bound for {request.tool!r}"
                    ) from exc
                except DeliveryError as exc:
                    raise ToolUnavailableError(
                        f"tool unavailable: the broker refused the call ({exc})"
                    ) from exc
                except (AMQPError, ChannelInvalidStateError, ConnectionError) as exc:
                    # the call never left (channel or connection down): not the tool's failure;
                    # the step is redone once the connection is back
                    raise RetryableError(f"could not send the tool call: {exc!r}") from exc
                failpoints.hit("tool_dispatched")
                return await future
        finally:
            self.futures.pop(number)
            _forget(self._by_key, key, number)
            _forget(self._by_correlation, request.call_id, number)

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        key = (message.headers or {}).get(H_IDEMPOTENCY_KEY)
        if key is not None:
            numbers = self._by_key.get(str(key), ())
        else:
            numbers = self._by_correlation.get(message.correlation_id or "", ())
        waiting = [f for f in (self.futures[n] for n in numbers) if not f.done()]
        if not waiting:
            log.debug("reply for an unknown or finished call %s", message.correlation_id)
            return
        try:
            reply = decode(message.body, ToolCallReply)
        except DecodeError as exc:
            error = ToolCallError(f"the tool service sent an invalid reply: {exc.reason}")
            for future in waiting:
                future.set_exception(error)
            return
        for future in waiting:
            future.set_result(reply)


def _forget(index: dict[str, set[int]], name: str, number: int) -> None:
    numbers = index.get(name)
    if numbers is not None:
        numbers.discard(number)
        if not numbers:
            index.pop(name)
