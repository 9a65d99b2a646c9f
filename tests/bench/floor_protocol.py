"""The protocol floor: the floor (``tests.bench.floor``) making every broker and Redis operation
the design requires of a turn (DESIGN.md: accepted turns queued per session, state fenced by a
session lease, the model's answer saved before any tool runs, history appended rather than
rewritten, confirmed ``mandatory`` tool calls, the lifecycle events, the ``openai`` client),
still built from the raw libraries only, with no loopwire code. It answers how much of
loopwire's cost over the floor is the protocol and how much is loopwire.

A turn starts with a start message, as loopwire's do: an accept script records the request and
queues the turn in its session, ``turn.accepted`` is published, then step 0 (and the start
message is acked). Per step, on top of the floor's consume, model call and ack:

- a script takes the session lease (a fencing token from a counter) and reads the state and the
  session history (a list of msgpack messages), and at step 0 the session's queue head and the
  turn's request too; step 0 saves the turn's input (``turn.started``);
- the model's answer is saved (compare-and-set fenced by the lease, beside the state) before
  the tool runs; the step's save appends its two messages to the history and the step's record
  (a msgpack blob: the model's finish reason, usage and timing, the call's name, arguments,
  outcome and timing; not the tool's result, which the history holds) to the turn's list of
  steps (``...:turn:<turn_id>:steps``), and lets go of the lease; the last one also stores the
  result and dequeues the turn. The state itself is a few counters: its size is the same at
  every step of a turn, however long, so that a step writes what it adds and nothing it wrote
  before (the design's rule for long turns);
- the tool call is published on a channel with publisher confirms, ``mandatory``, with an
  ``idempotency-key`` header, and waits for the confirmation before the reply;
- the events: ``tool.invoking``, ``tool.invoked`` and ``step.completed`` every step, and
  ``turn.accepted``, ``turn.started`` and ``turn.completed`` once a turn (3.6 a step over a
  five-step turn, against the floor's one), with CloudEvents headers;
- every publish (``mandatory`` for work messages too) waits for the broker's confirmation only,
  not first for the socket to drain as aio-pika's ``Exchange.publish`` (which the floor uses)
  does, with the AMQP properties built directly;
- the model is called through the ``openai`` client's public ``post`` (the body as
  ``content``, the raw response) on its aiohttp transport.

It runs on uvloop and encodes JSON with orjson, as loopwire does (the floor uses the standard
loop and ``json``), so that the ratio to the floor counts the protocol's operations, not a
slower runtime. Left out: lease renewal, metrics, hooks, and the checks on messages from
outside.

The tool calls go to the tool protocol floor (``tests.bench.tool_floor``) on the protocol
floor's own queue: a raw responder making the idempotency bookkeeping a loopwire tool service
makes (claim, run, store, reply), so that the machine the protocol floor's worker shares carries
the same tool-side work as loopwire's (the calculator service's), not a responder that only
replies.

Run: ``python -m tests.bench.floor_protocol worker --model-url URL [--prefetch N]`` and
``python -m tests.bench.floor_protocol tool`` (the tool protocol floor on its own queue). With
``LW_BENCH_TOOL=lookup`` the worker offers the model the ``long`` scenario's ``lookup`` tool
instead of the calculator.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import aio_pika
import aiormq
import httpx2
import msgpack
import openai
import orjson
import uvloop
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from aiormq import spec
from redis.asyncio import Redis

from contracts.runtime.redis_client import ready, redis_client
from tests.bench import lookup
from tests.bench.floor import QUORUM, RawRpc, serve
from tests.bench.workload import (
    AMQP_URL,
    KEY_TTL_S,
    REDIS_CLUSTER,
    REDIS_URL,
    SYSTEM_PROMPT,
    TOOL,
    tool_definition,
)

WORK_QUEUE = "bench.floorp.work"
TOOL_QUEUE = "bench.floorp.tool"
EVENTS_EXCHANGE = "bench.floorp.events"
SOURCE = "/bench/floor_protocol"
LEASE_MS = 15_000
TOOL_ENV = "LW_BENCH_TOOL"
"""The tool the worker offers the model: the calculator (default) or ``lookup`` (the ``long``
scenario's)."""

# KEYS: turns, queue, requests ; ARGV: turn, request, ttl
_ACCEPT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 'duplicate' end
redis.call('HSET', KEYS[1], ARGV[1], 'queued')
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
local ahead = redis.call('RPUSH', KEYS[2], ARGV[1]) - 1
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[3]) end
if ahead == 0 then return 'start' end
return 'queued'
"""
# KEYS: lease, fence, state, history, queue, requests ; ARGV: lease ms, ttl, turn ('' unless
# step 0: then the queue head and the turn's request come too)
_LEASE = """
local token = redis.call('INCR', KEYS[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
if not redis.call('SET', KEYS[1], token, 'NX', 'PX', ARGV[1]) then return {0, false, false, {}} end
local s = redis.call('HMGET', KEYS[3], 'v', 's')
local reply = {token, s[1], s[2], redis.call('LRANGE', KEYS[4], 0, -1)}
if ARGV[3] ~= '' then
  reply[5] = redis.call('LINDEX', KEYS[5], 0) or ''
  reply[6] = redis.call('HGET', KEYS[6], ARGV[3]) or ''
end
return reply
"""
# KEYS: lease, state, history, turns, queue, result, the turn's steps ; ARGV: token, expected
# version, state, answer ('' = none), release (1/0), ttl, turn, result ('' = none), the step's
# record ('' = none), messages to append...
_SAVE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('STALE lease') end
local v = redis.call('HGET', KEYS[2], 'v')
if (v or '') ~= ARGV[2] then return redis.error_reply('STALE version') end
local next = (tonumber(v) or 0) + 1
redis.call('HSET', KEYS[2], 'v', next, 's', ARGV[3])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[2], 'a', ARGV[4]) else redis.call('HDEL', KEYS[2], 'a') end
if #ARGV > 9 then redis.call('RPUSH', KEYS[3], unpack(ARGV, 10)) end
if ARGV[9] ~= '' then
  redis.call('RPUSH', KEYS[7], ARGV[9])
  redis.call('EXPIRE', KEYS[7], ARGV[6])
end
if ARGV[8] ~= '' then
  redis.call('SET', KEYS[6], ARGV[8], 'EX', ARGV[6])
  redis.call('HSET', KEYS[4], ARGV[7], 'done')
  if redis.call('LINDEX', KEYS[5], 0) == ARGV[7] then redis.call('LPOP', KEYS[5]) end
end
if ARGV[5] == '1' then redis.call('DEL', KEYS[1]) end
redis.call('EXPIRE', KEYS[2], ARGV[6])
redis.call('EXPIRE', KEYS[3], ARGV[6])
return next
"""


def state_key(session_id: str, part: str = "state") -> str:
    return f"bench:floorp:{{{session_id}}}:{part}"


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
    """The driver's part: a session with ``history``, and the turn's start message."""
    key = state_key(session_id, "history")
    async with redis.pipeline(transaction=False) as pipe:
        pipe.rpush(key, *[msgpack.packb(m) for m in history])
        pipe.expire(key, KEY_TTL_S)
        await pipe.execute()
    start = {"s": session_id, "t": turn_id, "n": steps, "r": reply_to, "input": user_input}
    await publish(msgpack.packb(start), WORK_QUEUE)


def properties(**values: Any) -> spec.Basic.Properties:
    return spec.Basic.Properties(headers=values.pop("headers", {}), **values)


async def publish_confirmed(
    channel: AbstractChannel,
    exchange: str,
    body: bytes,
    routing_key: str,
    props: spec.Basic.Properties,
    *,
    mandatory: bool = False,
) -> None:
    """Publish on the aio-pika channel's aiormq channel and wait for the broker's confirmation
    only (``Exchange.publish`` first waits for the socket to drain, which the confirmation
    implies): the tightest confirmed publish the libraries offer, and loopwire's."""
    underlay = await channel.get_underlay_channel()
    assert isinstance(underlay, aiormq.Channel)  # what aio-pika's channels are built on
    await underlay.basic_publish(
        body,
        exchange=exchange,
        routing_key=routing_key,
        properties=props,
        mandatory=mandatory,
        wait=False,
    )


class ConfirmedRpc(RawRpc):
    """The raw RPC client on a confirming channel (``call_confirmed``; the inherited ``call``
    is the plain floor's): ``mandatory``, idempotency key, and the publish waits for the
    broker's confirmation (an unroutable call fails at once)."""

    async def call_confirmed(self, body: bytes, key: str) -> Any:
        call_id = uuid.uuid4().hex
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.futures[call_id] = future
        try:
            await publish_confirmed(
                self.channel,
                "",
                body,
                TOOL_QUEUE,
                properties(
                    correlation_id=call_id,
                    reply_to=self.reply_to,
                    expiration="30000",
                    headers={"idempotency-key": key},
                    message_id=call_id,
                ),
                mandatory=True,
            )
            return msgpack.unpackb(await asyncio.wait_for(future, 30))
        finally:
            self.futures.pop(call_id, None)


class ProtocolFloorWorker:
    """Handles start messages (accept, ``turn.accepted``, step 0) and step messages."""

    def __init__(self, model_url: str, prefetch: int) -> None:
        self.url = model_url
        self.prefetch = prefetch
        tool = os.environ.get(TOOL_ENV, TOOL)
        self.tools = [lookup.definition() if tool == lookup.LOOKUP else tool_definition()]

    async def run(self, stop: asyncio.Event) -> None:
        redis = await ready(
            redis_client(REDIS_URL, cluster=REDIS_CLUSTER, max_connections=128, timeout=10)
        )
        self.redis = redis
        self.accept = redis.register_script(_ACCEPT)
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
            self.publish = await connection.channel(publisher_confirms=True)
            await self.publish.declare_exchange(
                EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, auto_delete=True
            )
            rpc_channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            self.rpc = ConfirmedRpc(rpc_channel)
            await self.rpc.start()
            queue = await consume.declare_queue(WORK_QUEUE, durable=True, arguments=QUORUM)
            await queue.consume(self.on_message)
            print("ready", flush=True)
            await stop.wait()
        finally:
            await self.client.close()
            await connection.close()
            await redis.aclose()

    async def event(self, kind: str, work: dict[str, Any], data: dict[str, Any], key: str) -> None:
        turn, step, now = work["t"], work.get("k"), time.time()
        event_id = hashlib.sha1(f"{kind}/{turn}/{step}/{key}".encode()).hexdigest()
        body = {
            "schema_version": 1,
            "id": event_id,
            "type": kind,
            "source": SOURCE,
            "time": now,
            "agent": "bench",
            "turn_id": turn,
            "session_id": work["s"],
            "step": step,
            "data": data,
        }
        headers = {
            "ce-specversion": "1.0",
            "ce-id": event_id,
            "ce-type": kind,
            "ce-source": SOURCE,
            "ce-time": datetime.fromtimestamp(now, UTC).isoformat(),
            "ce-subject": turn,
        }
        await publish_confirmed(
            self.publish,
            EVENTS_EXCHANGE,
            msgpack.packb(body),
            f"{kind}.bench.{turn}",
            properties(
                content_type="application/msgpack",
                delivery_mode=1,
                headers=headers,
                message_id=event_id,
                message_type=kind,
                timestamp=datetime.fromtimestamp(now, UTC),
            ),
        )

    async def send_work(self, work: dict[str, Any]) -> None:
        await publish_confirmed(
            self.publish,
            "",
            msgpack.packb(work),
            WORK_QUEUE,
            properties(delivery_mode=2, message_id=uuid.uuid4().hex),
            mandatory=True,
        )

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        work = msgpack.unpackb(message.body)
        if "input" in work:
            await self.on_start(work)
        else:
            await self.on_step(work)
        await message.ack()

    async def on_start(self, start: dict[str, Any]) -> None:
        session, turn = start["s"], start["t"]
        status = await self.accept(
            keys=[state_key(session, p) for p in ("turns", "queue", "requests")],
            args=[turn, msgpack.packb(start), KEY_TTL_S],
        )
        await self.event("turn.accepted", start, {"persist": True, "input_messages": 1}, "")
        if status == b"start":
            await self.send_work(
                {"s": session, "t": turn, "k": 0, "n": start["n"], "r": start["r"]}
            )

    async def on_step(self, work: dict[str, Any]) -> None:
        started = time.monotonic()
        session, turn, step, steps = work["s"], work["t"], work["k"], work["n"]
        parts = ("lease", "fence", "state", "history", "queue", "requests")
        keys = {p: state_key(session, p) for p in parts}
        token, version, blob, history, *opening = await self.lease(
            keys=list(keys.values()), args=[LEASE_MS, KEY_TTL_S, turn if step == 0 else ""]
        )
        if not token:
            raise RuntimeError(f"the lease of {session} is held")
        state = msgpack.unpackb(blob) if blob else {"turn": turn, "steps": 0}
        messages = [msgpack.unpackb(m) for m in history]

        async def save(
            append: list[dict[str, Any]],
            answer: bytes = b"",
            release: bool = False,
            result: bytes = b"",
            record: bytes = b"",
        ) -> int:
            saved: int = await self.save(
                keys=[
                    keys["lease"],
                    keys["state"],
                    keys["history"],
                    state_key(session, "turns"),
                    state_key(session, "queue"),
                    state_key(session, "result"),
                    state_key(session, f"turn:{turn}:steps"),
                ],
                args=[
                    token,
                    version or "",
                    msgpack.packb(state),
                    answer,
                    "1" if release else "0",
                    KEY_TTL_S,
                    turn,
                    result,
                    record,
                    *[msgpack.packb(m) for m in append],
                ],
            )
            return saved

        if step == 0:
            head, request = opening
            if head != turn.encode() or not request:
                raise RuntimeError(f"turn {turn} is not its session's head")
            user = {"role": "user", "content": msgpack.unpackb(request)["input"]}
            state["turn"] = turn
            version = await save([user])
            messages.append(user)
            await self.event("turn.started", work, {"history_len": len(messages) - 1}, "")
        body = {
            "model": "bench",
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, *messages],
            "tools": self.tools,
        }
        asked = time.time()
        response = await self.client.post(
            "/chat/completions", cast_to=httpx2.Response, content=orjson.dumps(body)
        )
        completion = orjson.loads(response.content)
        answered = time.time()
        answer = completion["choices"][0]["message"]
        assistant = {
            "role": "assistant",
            "content": answer.get("content"),
            "tool_calls": answer["tool_calls"],
        }
        version = await save([], answer=msgpack.packb(assistant))
        call = answer["tool_calls"][0]
        name = call["function"]["name"]
        await self.event("tool.invoking", work, {"tool": name, "call_id": call["id"]}, call["id"])
        called, call_started = time.monotonic(), time.time()
        key = f"{turn}:{call['id']}"
        request = {
            "schema_version": 1,
            "call_id": call["id"],
            "tool": name,
            "arguments": orjson.loads(call["function"]["arguments"]),
            "context": {
                "session_id": session,
                "turn_id": turn,
                "agent": "bench",
                "metadata": {},
                "deadline": time.time() + 30,
                "idempotency_key": key,
            },
        }
        reply = await self.rpc.call_confirmed(msgpack.packb(request), key)
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
        tool = {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": orjson.dumps(reply["value"]).decode(),
        }
        record = {  # what the step did, beside the history that holds its messages
            "index": step,
            "type": "tool_execution",
            "input_count": len(body["messages"]),
            "started_at": asked,
            "completed_at": time.time(),
            "response": {
                "finish_reason": completion["choices"][0].get("finish_reason"),
                "usage": completion.get("usage") or {},
                "model": completion.get("model", ""),
                "response_id": completion.get("id"),
                "duration_s": answered - asked,
            },
            "tools": [
                {
                    "call_id": call["id"],
                    "name": name,
                    "arguments": request["arguments"],
                    "outcome": "ok",
                    "content_chars": len(tool["content"]),
                    "truncated": False,
                    "started_at": call_started,
                    "completed_at": time.time(),
                }
            ],
        }
        state["steps"] += 1
        last = step + 1 >= steps
        result = msgpack.packb({"turn": turn, "finish_reason": "max_iterations"}) if last else b""
        await save([assistant, tool], release=True, result=result, record=msgpack.packb(record))
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
        if not last:
            await self.send_work({**work, "k": step + 1})
            return
        await self.event("turn.completed", work, {"finish_reason": "max_iterations"}, "")
        await publish_confirmed(
            self.publish,
            "",
            result,
            work["r"],
            properties(message_type="turn.result", correlation_id=turn, message_id=turn),
        )


def main() -> None:
    if sys.argv[1:2] == ["tool"]:
        # the tool protocol floor: the idempotency bookkeeping a loopwire tool service makes
        from tests.bench import tool_floor

        tool_floor.main(queue=TOOL_QUEUE)
        return
    serve(
        ProtocolFloorWorker,
        TOOL_QUEUE,
        "python -m tests.bench.floor_protocol",
        run=uvloop.run,
    )


if __name__ == "__main__":
    main()
