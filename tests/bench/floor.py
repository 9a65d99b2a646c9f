"""The floor: the tightest step that does what a loopwire step must do, built from the raw
libraries only (aio-pika, redis, aiohttp, msgpack, json), no loopwire code.

One step per delivery, as loopwire's design requires: consume the step message; load the
session state from Redis (one ``HMGET``: version + msgpack blob with the messages); POST the
chat-completions request (system prompt + history + the turn so far, tool definitions) with
aiohttp and ``json.loads`` the answer; one tool RPC over RabbitMQ (``reply_to`` +
``correlation_id``, future per call) to the raw responder; append the two new messages and save
with one Lua compare-and-set on the version; publish one event; publish the next step message
(or the turn's reply); ack. Publishes go through a channel with publisher confirms, as loopwire's
do (a step is acked only after what it published is confirmed). The floor re-serializes its
whole state on every save: with msgpack that is the cheapest possible write.

Run: ``python -m tests.bench.floor worker --model-url URL [--prefetch N]`` and
``python -m tests.bench.floor tool`` (the raw tool responder).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import aio_pika
import aiohttp
import msgpack
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractIncomingMessage
from redis.asyncio import Redis

from contracts.runtime.redis_client import ready, redis_client
from tests.bench.workload import (
    AMQP_URL,
    KEY_TTL_S,
    REDIS_CLUSTER,
    REDIS_URL,
    SYSTEM_PROMPT,
    tool_definition,
)

WORK_QUEUE = "bench.floor.work"
TOOL_QUEUE = "bench.floor.tool"
EVENTS_EXCHANGE = "bench.floor.events"
QUORUM: dict[str, Any] = {"x-queue-type": "quorum"}
TOOL_REPLY = msgpack.packb({"status": "ok", "value": {"expression": "6*7", "value": "42"}})

# KEYS: state ; ARGV: expected version, new blob
_SAVE = """
local v = redis.call('HGET', KEYS[1], 'v')
if v ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'v', tonumber(v) + 1, 's', ARGV[2])
return 1
"""


def state_key(session_id: str) -> str:
    return f"bench:floor:{{{session_id}}}"


class RawRpc:
    """A raw aio-pika RPC client: one exclusive reply queue, a dict of futures."""

    def __init__(self, channel: AbstractChannel) -> None:
        self.channel = channel
        self.futures: dict[str, asyncio.Future[bytes]] = {}
        self.reply_to = ""

    async def start(self) -> None:
        queue = await self.channel.declare_queue(exclusive=True, auto_delete=True)
        self.reply_to = queue.name
        await queue.consume(self._on_reply, no_ack=True)

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        future = self.futures.pop(message.correlation_id or "", None)
        if future is not None and not future.done():
            future.set_result(message.body)

    async def call(self, body: bytes, routing_key: str = TOOL_QUEUE) -> Any:
        call_id = uuid.uuid4().hex
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.futures[call_id] = future
        await self.channel.default_exchange.publish(
            aio_pika.Message(body, correlation_id=call_id, reply_to=self.reply_to, expiration=30),
            routing_key=routing_key,
        )
        return msgpack.unpackb(await asyncio.wait_for(future, 30))


class FloorWorker:
    def __init__(self, model_url: str, prefetch: int) -> None:
        self.url = model_url.rstrip("/") + "/chat/completions"
        self.prefetch = prefetch
        self.tools = [tool_definition()]

    async def run(self, stop: asyncio.Event) -> None:
        redis = await ready(
            redis_client(REDIS_URL, cluster=REDIS_CLUSTER, max_connections=128, timeout=10)
        )
        self.save = redis.register_script(_SAVE)
        self.redis = redis
        connection = await aio_pika.connect(AMQP_URL)
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.http = http
        try:
            consume = await connection.channel(publisher_confirms=False)
            await consume.set_qos(prefetch_count=self.prefetch)
            publish = await connection.channel(publisher_confirms=True)
            self.publish = publish
            self.events: AbstractExchange = await publish.declare_exchange(
                EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, auto_delete=True
            )
            self.rpc = RawRpc(await connection.channel(publisher_confirms=False))
            await self.rpc.start()
            queue = await consume.declare_queue(WORK_QUEUE, durable=True, arguments=QUORUM)
            await queue.consume(self.on_step)
            print("ready", flush=True)
            await stop.wait()
        finally:
            await http.close()
            await connection.close()
            await redis.aclose()

    async def on_step(self, message: AbstractIncomingMessage) -> None:
        work = msgpack.unpackb(message.body)
        session, step, steps = work["s"], work["k"], work["n"]
        key = state_key(session)
        version, blob = await self.redis.hmget(key, ["v", "s"])
        state = msgpack.unpackb(blob)
        messages = state["messages"]
        body = {
            "model": "bench",
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, *messages],
            "tools": self.tools,
        }
        async with self.http.post(
            self.url,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Bearer bench"},
        ) as response:
            response.raise_for_status()
            completion = json.loads(await response.read())
        answer = completion["choices"][0]["message"]
        call = answer["tool_calls"][0]
        reply = await self.rpc.call(
            msgpack.packb(
                {
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "args": call["function"]["arguments"],
                }
            )
        )
        messages.append(
            {
                "role": "assistant",
                "content": answer.get("content"),
                "tool_calls": answer["tool_calls"],
            }
        )
        messages.append(
            {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(reply["value"])}
        )
        saved = await self.save(keys=[key], args=[version or b"", msgpack.packb(state)])
        if not saved:
            raise RuntimeError(f"stale state for {session}")
        await self.events.publish(
            aio_pika.Message(
                msgpack.packb({"type": "step.completed", "turn": work["t"], "step": step}),
                message_id=f"{work['t']}:{step}",
                type="step.completed",
            ),
            routing_key=f"step.completed.bench.{work['t']}",
        )
        if step + 1 < steps:
            await self.publish.default_exchange.publish(
                aio_pika.Message(
                    msgpack.packb({**work, "k": step + 1}),
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=WORK_QUEUE,
            )
        else:
            await self.publish.default_exchange.publish(
                aio_pika.Message(
                    msgpack.packb({"turn": work["t"]}), type="turn.result", correlation_id=work["t"]
                ),
                routing_key=work["r"],
            )
        await message.ack()


async def run_tool_responder(
    stop: asyncio.Event, concurrency: int = 64, queue_name: str = TOOL_QUEUE
) -> None:
    """The raw tool responder: answer every call at once with a fixed value."""
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=concurrency)
        queue = await channel.declare_queue(queue_name, durable=True, arguments=QUORUM)
        exchange = channel.default_exchange

        async def on_call(message: AbstractIncomingMessage) -> None:
            await exchange.publish(
                aio_pika.Message(TOOL_REPLY, correlation_id=message.correlation_id),
                routing_key=message.reply_to or "",
            )
            await message.ack()

        await queue.consume(on_call)
        print("ready", flush=True)
        await stop.wait()
    finally:
        await connection.close()


async def seed_and_start(
    redis: Redis,
    publish: Callable[[bytes, str], Awaitable[None]],
    history: list[dict[str, Any]],
    *,
    session_id: str,
    turn_id: str,
    user_input: str,
    steps: int,
    reply_to: str,
) -> None:
    """The driver's part: a session holding ``history`` and the turn's input, and its first
    step message."""
    messages = [*history, {"role": "user", "content": user_input}]
    key = state_key(session_id)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(key, mapping={"v": 1, "s": msgpack.packb({"messages": messages})})
        pipe.expire(key, KEY_TTL_S)
        await pipe.execute()
    work = {"s": session_id, "t": turn_id, "k": 0, "n": steps, "r": reply_to}
    await publish(msgpack.packb(work), WORK_QUEUE)


class StepWorker(Protocol):
    async def run(self, stop: asyncio.Event) -> None: ...


def serve(
    worker: Callable[[str, int], StepWorker],
    tool_queue: str,
    prog: str,
    run: Callable[[Coroutine[Any, Any, None]], None] = asyncio.run,
) -> None:
    """The command line of a floor: ``worker`` (until SIGINT/SIGTERM) or ``tool`` (the raw tool
    responder on ``tool_queue``), run by ``run`` (``asyncio.run``, or uvloop's)."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("role", choices=["worker", "tool"])
    parser.add_argument("--model-url", default="")
    parser.add_argument("--prefetch", type=int, default=64)
    args = parser.parse_args()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        if args.role == "worker":
            await worker(args.model_url, args.prefetch).run(stop)
        else:
            await run_tool_responder(stop, queue_name=tool_queue)

    with contextlib.suppress(KeyboardInterrupt):
        run(main())


def main() -> None:
    serve(FloorWorker, TOOL_QUEUE, "python -m tests.bench.floor")


if __name__ == "__main__":
    main()
