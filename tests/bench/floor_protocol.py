"""The protocol floor: the floor (``tests.bench.floor``) making every operation the design
requires of a step (DESIGN.md: fenced state, the model's answer saved before any tool runs,
confirmed ``mandatory`` tool calls, the lifecycle events, the ``openai`` client), still built
from the raw libraries only, with no loopwire code. It answers how much of loopwire's cost over
the floor is the protocol and how much is loopwire.

Per step, on top of the floor's consume, model call and ack:

- the state is read by a Lua script that takes the session lease (a fencing token from a
  counter) instead of a plain ``HMGET``;
- the model's answer is saved (compare-and-set fenced by the lease, the answer beside the
  state) before the tool runs, and the step is saved, letting go of the lease, after it: two
  writes instead of one;
- the tool call is published on a channel with publisher confirms, ``mandatory``, with an
  ``idempotency-key`` header, and waits for the confirmation before the reply;
- every publish waits for the broker's confirmation only, not first for the socket to drain as
  aio-pika's ``Exchange.publish`` (which the floor uses) does: the protocol at its tightest;
- the events are loopwire's, published with confirms and CloudEvents headers: ``tool.invoking``,
  ``tool.invoked`` and ``step.completed`` every step, ``turn.started`` on a turn's first step
  and ``turn.completed`` on its last (3.4 a step over a five-step turn, against the floor's one);
- the model is called through the ``openai`` client, as the design requires: its public
  ``post`` with the JSON body as ``content`` and the raw response, on its aiohttp transport.

The state keeps the floor's layout: one msgpack blob with the messages, written whole at the
step's save; the answer saved before the tool runs goes beside it. A turn's acceptance
(loopwire's ``accept`` script and ``turn.accepted`` event) is left out: it is not a step.

Run: ``python -m tests.bench.floor_protocol worker --model-url URL [--prefetch N]`` and
``python -m tests.bench.floor_protocol tool`` (the raw tool responder on its own queue).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import aio_pika
import aiormq
import httpx2
import msgpack
import openai
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from redis.asyncio import BlockingConnectionPool, Redis

from tests.bench.floor import QUORUM, RawRpc, serve
from tests.bench.workload import AMQP_URL, REDIS_URL, SYSTEM_PROMPT, tool_definition

WORK_QUEUE = "bench.floorp.work"
TOOL_QUEUE = "bench.floorp.tool"
EVENTS_EXCHANGE = "bench.floorp.events"
LEASE_MS = 15_000
KEY_TTL_MS = 900_000
_NAMESPACE = uuid.UUID("0b6f3c2e-1d4a-4c59-8e7b-2f9a6d1c3e55")

# KEYS: lease, fence, state ; ARGV: lease ms, key ttl ms
_LEASE = """
local token = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
if not redis.call('SET', KEYS[1], token, 'NX', 'PX', ARGV[1]) then return {0} end
local s = redis.call('HMGET', KEYS[3], 'v', 's')
return {token, s[1], s[2]}
"""
# KEYS: lease, state ; ARGV: token, expected version, field, value, release (1/0)
_SAVE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('STALE lease') end
local v = redis.call('HGET', KEYS[2], 'v')
if v ~= ARGV[2] then return redis.error_reply('STALE version') end
local next = tonumber(v) + 1
redis.call('HSET', KEYS[2], 'v', next, ARGV[3], ARGV[4])
if ARGV[5] == '1' then
  redis.call('HDEL', KEYS[2], 'a')
  redis.call('DEL', KEYS[1])
end
return next
"""


async def publish_confirmed(
    channel: AbstractChannel,
    exchange: str,
    message: aio_pika.Message,
    routing_key: str,
    *,
    mandatory: bool = False,
) -> None:
    """Publish on the aio-pika channel's aiormq channel and wait for the broker's confirmation
    only (``Exchange.publish`` first waits for the socket to drain, which the confirmation
    implies): the tightest confirmed publish the libraries offer, and loopwire's."""
    underlay = await channel.get_underlay_channel()
    assert isinstance(underlay, aiormq.Channel)  # what aio-pika's channels are built on
    await underlay.basic_publish(
        message.body,
        exchange=exchange,
        routing_key=routing_key,
        properties=message.properties,
        mandatory=mandatory,
        wait=False,
    )


def state_key(session_id: str) -> str:
    return f"bench:floorp:{{{session_id}}}"


class ConfirmedRpc(RawRpc):
    """The raw RPC client on a confirming channel: ``mandatory``, idempotency key, and the
    publish waits for the broker's confirmation (an unroutable call fails at once)."""

    async def call_confirmed(self, body: bytes, key: str) -> Any:
        call_id = uuid.uuid4().hex
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.futures[call_id] = future
        try:
            await publish_confirmed(
                self.channel,
                "",
                aio_pika.Message(
                    body,
                    correlation_id=call_id,
                    reply_to=self.reply_to,
                    expiration=30,
                    headers={"idempotency-key": key},
                ),
                TOOL_QUEUE,
                mandatory=True,
            )
            return msgpack.unpackb(await asyncio.wait_for(future, 30))
        finally:
            self.futures.pop(call_id, None)


class ProtocolFloorWorker:
    def __init__(self, model_url: str, prefetch: int) -> None:
        self.url = model_url
        self.prefetch = prefetch
        self.tools = [tool_definition()]

    async def run(self, stop: asyncio.Event) -> None:
        pool = BlockingConnectionPool.from_url(REDIS_URL, max_connections=128, timeout=10)
        redis = Redis.from_pool(pool)
        self.lease = redis.register_script(_LEASE)
        self.save = redis.register_script(_SAVE)
        connection = await aio_pika.connect(AMQP_URL)
        self.client = openai.AsyncOpenAI(
            base_url=self.url,
            api_key="bench",
            timeout=30,
            http_client=openai.DefaultAioHttpClient(
                limits=httpx2.Limits(max_connections=1000, max_keepalive_connections=1000)
            ),
        )
        try:
            consume = await connection.channel(publisher_confirms=False)
            await consume.set_qos(prefetch_count=self.prefetch)
            publish = await connection.channel(publisher_confirms=True)
            self.publish = publish
            await publish.declare_exchange(
                EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, auto_delete=True
            )
            rpc_channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            self.rpc = ConfirmedRpc(rpc_channel)
            await self.rpc.start()
            queue = await consume.declare_queue(WORK_QUEUE, durable=True, arguments=QUORUM)
            await queue.consume(self.on_step)
            print("ready", flush=True)
            await stop.wait()
        finally:
            await self.client.close()
            await connection.close()
            await redis.aclose()

    async def event(self, kind: str, work: dict[str, Any], data: dict[str, Any], key: str) -> None:
        turn, now = work["t"], time.time()
        event_id = str(uuid.uuid5(_NAMESPACE, f"{kind}/{turn}/{work['k']}/{key}"))
        body = {
            "schema_version": 1,
            "id": event_id,
            "type": kind,
            "source": "/bench/floor",
            "time": now,
            "agent": "bench",
            "turn_id": turn,
            "session_id": work["s"],
            "step": work["k"],
            "data": data,
        }
        await publish_confirmed(
            self.publish,
            EVENTS_EXCHANGE,
            aio_pika.Message(
                msgpack.packb(body),
                content_type="application/msgpack",
                headers={
                    "ce-specversion": "1.0",
                    "ce-id": event_id,
                    "ce-type": kind,
                    "ce-source": "/bench/floor",
                    "ce-time": datetime.fromtimestamp(now, UTC).isoformat(),
                    "ce-subject": turn,
                },
                message_id=event_id,
                type=kind,
                timestamp=now,
            ),
            f"{kind}.bench.{turn}",
        )

    async def on_step(self, message: AbstractIncomingMessage) -> None:
        started = time.monotonic()
        work = msgpack.unpackb(message.body)
        session, step, steps = work["s"], work["k"], work["n"]
        key = state_key(session)
        lease_key, fence_key = f"{key}:lease", f"{key}:fence"
        token, version, blob = await self.lease(
            keys=[lease_key, fence_key, key], args=[LEASE_MS, KEY_TTL_MS]
        )
        if not token:
            raise RuntimeError(f"lease of {session} is held")
        state = msgpack.unpackb(blob)
        messages = state["messages"]
        if step == 0:
            await self.event("turn.started", work, {"history_len": len(messages)}, "")
        body = {
            "model": "bench",
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, *messages],
            "tools": self.tools,
        }
        response = await self.client.post(
            "/chat/completions", cast_to=httpx2.Response, content=json.dumps(body).encode()
        )
        completion = json.loads(response.content)
        answer = completion["choices"][0]["message"]
        messages.append(
            {
                "role": "assistant",
                "content": answer.get("content"),
                "tool_calls": answer["tool_calls"],
            }
        )
        version = await self.save(  # the answer only, beside the state
            keys=[lease_key, key], args=[token, version, "a", msgpack.packb(messages[-1]), "0"]
        )
        call = answer["tool_calls"][0]
        name = call["function"]["name"]
        await self.event("tool.invoking", work, {"tool": name, "call_id": call["id"]}, call["id"])
        called = time.monotonic()
        reply = await self.rpc.call_confirmed(
            msgpack.packb({"id": call["id"], "name": name, "args": call["function"]["arguments"]}),
            f"{work['t']}:{call['id']}",
        )
        await self.event(
            "tool.invoked",
            work,
            {
                "tool": name,
                "call_id": call["id"],
                "outcome": "ok",
                "duration_s": time.monotonic() - called,
            },
            call["id"],
        )
        messages.append(
            {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(reply["value"])}
        )
        await self.save(
            keys=[lease_key, key], args=[token, version, "s", msgpack.packb(state), "1"]
        )
        await self.event(
            "step.completed",
            work,
            {
                "step_type": "tool_execution",
                "finish_reason": "tool_calls",
                "tool_calls": 1,
                "usage": completion.get("usage") or {},
                "duration_s": time.monotonic() - started,
            },
            "",
        )
        if step + 1 < steps:
            await publish_confirmed(
                self.publish,
                "",
                aio_pika.Message(
                    msgpack.packb({**work, "k": step + 1}),
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                WORK_QUEUE,
            )
        else:
            await self.event("turn.completed", work, {"finish_reason": "max_iterations"}, "")
            await publish_confirmed(
                self.publish,
                "",
                aio_pika.Message(
                    msgpack.packb({"turn": work["t"]}), type="turn.result", correlation_id=work["t"]
                ),
                work["r"],
            )
        await message.ack()


def main() -> None:
    serve(ProtocolFloorWorker, TOOL_QUEUE, "python -m tests.bench.floor_protocol")


if __name__ == "__main__":
    main()
