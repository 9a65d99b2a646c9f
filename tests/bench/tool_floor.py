"""The tool protocol floor: a raw aio-pika responder making the idempotency bookkeeping a
loopwire tool service makes for every call (``tool_services/calls.py``), and nothing else.

Per call: decode the request (msgpack, no validation beyond what the function needs); drop it
if its deadline has passed; claim it by its idempotency key (one Lua script: a stored reply is
sent again, a call claimed elsewhere whose lease is alive is waited for, otherwise it is claimed
with a lease); run the function, the calculator's evaluation of the expression
(``tool_services/calculator/evaluator.py``, the same function the SDK's service runs), or for
the ``long`` scenario's ``lookup`` calls ``tests.bench.lookup.lookup_result`` (the function the
bench's SDK lookup service runs); store the
reply, first writer wins, letting go of the lease (one Lua script); publish the reply on a
confirming channel (waiting for the broker's confirmation only, as ``floor_protocol`` does)
with the request's ``correlation_id`` and ``idempotency-key`` echoed; ack. Two Redis round trips
a call: the claim must come before the function runs and the store after it, before the reply.
It runs on the standard asyncio loop and encodes with msgpack, as the SDK's service does.

Left out: the SDK's argument model, metrics, tracing, the task and semaphore per call, the
lease renewal (the function runs synchronously and is bounded, so nothing could renew the lease
while it runs anyway), the announcement heartbeat. It consumes the SDK service's own queue
(``loopwire.tool.calculate``, bound to ``loopwire.tools``): the benchmark runs one of the two at
a time, so the same messages from the same caller reach either.

Run: ``python -m tests.bench.tool_floor``; prints ``ready`` once consuming.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
from typing import Any

import aio_pika
import msgpack
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from contracts.runtime.redis_client import ready, redis_client
from contracts.topology import CONTENT_TYPE, H_IDEMPOTENCY_KEY, TOOLS_EXCHANGE, tool_queue
from tests.bench.floor import QUORUM
from tests.bench.floor_protocol import properties, publish_confirmed
from tests.bench.lookup import LOOKUP, lookup_result
from tests.bench.workload import AMQP_URL, KEY_TTL_S, REDIS_CLUSTER, REDIS_URL, TOOL
from tool_services.calculator.evaluator import (
    EvaluationError,
    evaluate,
    format_decimal,
    format_exact,
)

CONCURRENCY = 256
"""Calls in flight (the channel's prefetch), as the bench runs the SDK's service."""
LEASE_MS = 3000
POLL_S = 0.05
"""How often a call claimed elsewhere is looked at again (the SDK's ``duplicate_poll_s``)."""

# KEYS: call, lease ; ARGV: owner, token, lease ms, ttl s
_CLAIM = """
local reply = redis.call('HGET', KEYS[1], 'reply')
if reply then return {'done', reply} end
if redis.call('HSETNX', KEYS[1], 'owner', ARGV[1]) == 0 then
  if redis.call('EXISTS', KEYS[2]) == 1 then return {'running', ''} end
  redis.call('HSET', KEYS[1], 'owner', ARGV[1])
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return {'run', ''}
"""
# KEYS: call, lease ; ARGV: reply, status, ttl s, token
_STORE = """
local existing = redis.call('HGET', KEYS[1], 'reply')
if not existing then
  redis.call('HSET', KEYS[1], 'reply', ARGV[1], 'status', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
if redis.call('GET', KEYS[2]) == ARGV[4] then redis.call('DEL', KEYS[2]) end
return existing
"""


def call_keys(key: str) -> list[str]:
    """The claim (a hash: owner, reply, status) and the lease of one idempotency key."""
    return [f"bench:toolfloor:{{{key}}}", f"bench:toolfloor:{{{key}}}:lease"]


def calculate(call_id: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The reply (a ``ToolCallReply`` as plain data) of the calculator to ``arguments``."""
    expression = arguments.get("expression")
    try:
        if not isinstance(expression, str):
            raise EvaluationError("expression: a string is required")
        value = evaluate(expression)
    except EvaluationError as exc:
        return reply(call_id, "error", error=str(exc))
    result = {"expression": expression, "value": format_exact(value)}
    if value.denominator != 1:
        result["decimal"] = format_decimal(value)
    return reply(call_id, "ok", value=result)


def respond(request: dict[str, Any]) -> dict[str, Any]:
    """The reply to a call: the ``long`` scenario's ``lookup`` (``tests.bench.lookup``, the
    function the SDK's bench service runs), or the calculator for any other tool name."""
    arguments = request["arguments"]
    if request["tool"] == LOOKUP:
        query, size = arguments.get("query"), arguments.get("size", 4096)
        if not isinstance(query, str) or not isinstance(size, int):
            return reply(request["call_id"], "error", error="query and size are required")
        return reply(request["call_id"], "ok", value=lookup_result(query, size))
    return calculate(request["call_id"], arguments)


def reply(
    call_id: str, status: str, *, value: Any = None, error: str | None = None
) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "call_id": call_id,
        "status": status,
        "value": value,
        "error": error,
        "state_updates": {},
    }


class ToolFloor:
    def __init__(self, queue: str | None = None) -> None:
        self.owner = f"toolfloor-{os.getpid()}"
        self.tokens = itertools.count()
        self.queue = queue
        """A queue of its own on the default exchange (the protocol floor's), instead of the
        calculator's."""

    async def run(self, stop: asyncio.Event) -> None:
        redis = await ready(
            redis_client(
                REDIS_URL, cluster=REDIS_CLUSTER, max_connections=CONCURRENCY + 16, timeout=10
            )
        )
        self.claim = redis.register_script(_CLAIM)
        self.store = redis.register_script(_STORE)
        connection = await aio_pika.connect(AMQP_URL)
        try:
            channel = await connection.channel(publisher_confirms=True)
            await channel.set_qos(prefetch_count=CONCURRENCY)
            self.channel: AbstractChannel = channel
            exchange = await channel.declare_exchange(
                TOOLS_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
            )
            if self.queue is None:
                queue = await channel.declare_queue(
                    tool_queue(TOOL), durable=True, arguments=QUORUM
                )
                await queue.bind(exchange, routing_key=TOOL)
            else:
                queue = await channel.declare_queue(self.queue, durable=True, arguments=QUORUM)
            await queue.consume(self.on_call)
            print("ready", flush=True)
            await stop.wait()
        finally:
            await connection.close()
            await redis.aclose()

    async def on_call(self, message: AbstractIncomingMessage) -> None:
        request = msgpack.unpackb(message.body)
        context = request["context"]
        if time.time() >= context["deadline"]:
            await message.ack()  # the caller no longer waits
            return
        body = await self.answer(request, context["idempotency_key"])
        if message.reply_to:
            headers = {H_IDEMPOTENCY_KEY: (message.headers or {}).get(H_IDEMPOTENCY_KEY, "")}
            await publish_confirmed(
                self.channel,
                "",
                body,
                message.reply_to,
                properties(
                    correlation_id=message.correlation_id,
                    content_type=CONTENT_TYPE,
                    delivery_mode=1,
                    headers=headers,
                ),
            )
        await message.ack()

    async def answer(self, request: dict[str, Any], key: str) -> bytes:
        """Claim the call, run it and store its reply; or the reply stored already."""
        keys = call_keys(key)
        token = f"{self.owner}:{next(self.tokens)}"
        while True:
            kind, stored = await self.claim(
                keys=keys, args=[self.owner, token, LEASE_MS, KEY_TTL_S]
            )
            if kind == b"done":
                earlier = msgpack.unpackb(stored)
                if earlier["call_id"] == request["call_id"]:
                    return bytes(stored)
                readdressed: bytes = msgpack.packb({**earlier, "call_id": request["call_id"]})
                return readdressed
            if kind == b"run":
                break
            await asyncio.sleep(POLL_S)  # running elsewhere: wait for its stored reply
        result = respond(request)
        body: bytes = msgpack.packb(result)
        earlier = await self.store(keys=keys, args=[body, result["status"], KEY_TTL_S, token])
        return bytes(earlier) if earlier else body


def main(queue: str | None = None) -> None:
    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await ToolFloor(queue).run(stop)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
