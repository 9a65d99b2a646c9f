"""Test harness for the distributed worker: real RabbitMQ and Redis, worker subprocesses,
a counting tool service speaking the raw wire protocol, and an event recorder."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
from aio_pika.abc import AbstractIncomingMessage
from redis.exceptions import ConnectionError
from support_rpc import AMQP_URL, REDIS_URL  # the suite's own vhost and Redis database

from contracts import keys
from contracts import topology as t
from contracts.client import LoopwireClient, TurnHandle
from contracts.codec import decode, encode
from contracts.events import Event
from contracts.runtime.amqp import connect
from contracts.runtime.redis_client import redis_client
from contracts.tools import ToolAnnouncement, ToolCallReply, ToolCallRequest, ToolDefinition
from worker.transport.topology import declare

ROOT = Path(__file__).resolve().parents[2]


SURVIVOR_ENV = {"LOOPWIRE_LEASE_TTL_S": "30"}
"""For the worker that finishes a turn after another died: the dead worker's lease lapses in
3 s (the suite's TTL), the survivor's own never does, however long a loaded machine holds up
its renewals (a lapsed lease lets a duplicate of the step in hand run it a second time)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def reset_topology() -> None:
    """Declare the topology and empty the turn queues so no earlier test's work leaks in."""
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        await declare(channel)
        # an earlier test's worker still shutting down must not take this test's work
        for _ in range(150):
            turns = await channel.declare_queue(t.TURNS_QUEUE, passive=True)
            if not turns.declaration_result.consumer_count:
                break
            await asyncio.sleep(0.1)
        for name in (t.TURNS_QUEUE, t.RETRY_QUEUE, t.DEAD_LETTER_QUEUE):
            queue = await channel.get_queue(name, ensure=False)
            await queue.purge()


class WorkerProcess:
    """``python -m worker`` in a subprocess, ready when its /readyz answers 200."""

    def __init__(
        self,
        *,
        model_url: str,
        agents_file: Path,
        extra_env: dict[str, str] | None = None,
        redis_url: str = REDIS_URL,
    ) -> None:
        self.port = free_port()
        self.env = {
            **os.environ,
            "LOOPWIRE_AMQP_URL": AMQP_URL,
            "LOOPWIRE_REDIS_URL": redis_url,
            "LOOPWIRE_MODEL__BASE_URL": model_url,
            "LOOPWIRE_MODEL__MAX_RETRIES": "0",
            "LOOPWIRE_AGENTS_FILE": str(agents_file),
            "LOOPWIRE_HTTP_PORT": str(self.port),
            "LOOPWIRE_BUSY_RETRY_S": "0.2",
            "LOOPWIRE_LEASE_TTL_S": "3",
            "LOOPWIRE_TOOLS_CACHE_S": "0",
            "LOOPWIRE_LOG_LEVEL": "DEBUG",
            # every history copied however short, so that every test runs the copies' path
            "LOOPWIRE_HISTORY_CACHE_MIN_KB": "0",
            **(extra_env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="loopwire-worker-", suffix=".log")[1])

    async def start(self, timeout: float = 20.0) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "worker"], env=self.env, cwd=ROOT, stderr=log, stdout=log
            )
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited: {self.stderr()}")
                try:
                    async with session.get(f"http://127.0.0.1:{self.port}/readyz") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError("worker did not become ready")

    def stderr(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def errors(self) -> list[str]:
        """Lines the worker logged at ERROR level, or tracebacks."""
        text = self.log_path.read_text(errors="replace")
        return [
            line for line in text.splitlines() if " ERROR " in line or line.startswith("Traceback")
        ]

    async def exited(self, timeout: float = 20.0) -> int:
        """Its exit code once it has exited (137: it reached a failpoint)."""
        assert self.proc is not None
        for _ in range(int(timeout * 20)):
            code = self.proc.poll()
            if code is not None:
                return code
            await asyncio.sleep(0.05)
        raise AssertionError("the worker did not exit (did it reach its failpoint?)")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        self.kill()

    async def __aenter__(self) -> WorkerProcess:
        """``async with WorkerProcess(...) as worker``: started, and killed at the end."""
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self.close()


def _listed(what: str, *columns: str) -> list[list[str]]:
    """``rabbitmqctl list_<what>`` of the tests' vhost: a row of ``columns`` per line."""
    vhost = urllib.parse.unquote(urllib.parse.urlsplit(AMQP_URL).path[1:]) or "/"
    out = subprocess.run(
        ["rabbitmqctl", "-q", f"list_{what}", "-p", vhost, *columns],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [line.split("\t") for line in out.splitlines()]


def event_bindings(pattern: str) -> int:
    """How many queues are bound to the events exchange with ``pattern`` (subscribers)."""
    rows = _listed("bindings", "source_name", "routing_key")
    return sum(row == [t.EVENTS_EXCHANGE, pattern] for row in rows)


def close_connection_owning(queue: str) -> None:
    """The broker closes the connection that owns the exclusive queue ``queue``."""
    owner = next(row[1] for row in _listed("queues", "name", "owner_pid") if row[0] == queue)
    subprocess.run(
        ["rabbitmqctl", "-q", "close_connection", owner, "test: connection drop"],
        capture_output=True,
        check=True,
        timeout=60,
    )


async def run_cli(
    *args: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``loopwire ARGS`` in a subprocess with ``env`` as its whole environment."""
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "worker.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )


async def subscribed(pattern: str, before: int, timeout: float = 30.0) -> None:
    """Wait until one more subscriber than ``before`` is bound with ``pattern``: it hears every
    event published from now on."""
    deadline = time.monotonic() + timeout
    while await asyncio.to_thread(event_bindings, pattern) <= before:
        if time.monotonic() > deadline:
            raise AssertionError(f"no subscriber bound {pattern!r} within {timeout}s")
        await asyncio.sleep(0.1)


async def run_past_a_crash(
    client: Any,
    model_url: str,
    agents: Path,
    point: str,
    agent: str,
    text: str,
    *,
    redis_url: str = REDIS_URL,
    **options: Any,
) -> tuple[Any, WorkerProcess]:
    """A turn started on a worker that dies at failpoint ``point`` and finished by a second
    worker, started only then: the result, and the survivor (to check its log). The doomed
    worker takes one message at a time, so that it dies holding only the step at ``point``
    (with more in flight, each of those would be redone too, as it should be)."""
    doomed = WorkerProcess(
        model_url=model_url,
        agents_file=agents,
        extra_env={"LOOPWIRE_FAILPOINTS": point, "LOOPWIRE_PREFETCH": "1"},
        redis_url=redis_url,
    )
    survivor = WorkerProcess(
        model_url=model_url, agents_file=agents, extra_env=SURVIVOR_ENV, redis_url=redis_url
    )
    await doomed.start()
    try:
        handle = await client.start_turn(agent, text, **options)
        assert await doomed.exited() == 137, "the worker did not reach its failpoint"
        await survivor.start()
        result = await handle.result(40)
        await handle.close()
    finally:
        doomed.close()
        survivor.close()
    return result, survivor


def write_agents(path: Path, tools: list[str], **limits: Any) -> Path:
    agents = {
        "agents": [
            {
                "name": "support",
                "system_prompt": "You are a support agent.",
                "tools": tools,
                "limits": limits,
            }
        ]
    }
    path.write_text(json.dumps(agents))
    return path


ToolBody = Callable[[ToolCallRequest], Awaitable[Any]]


class CountingToolService:
    """A tool service in the test process, written against the raw wire protocol.

    It counts executions per idempotency key and answers repeated keys from its store,
    as the SDK's services do."""

    def __init__(
        self,
        name: str,
        body: ToolBody,
        *,
        idempotent: bool = True,
        timeout_s: float = 10,
        redis_url: str = REDIS_URL,
        announce: bool = True,
        bind: bool = True,
    ) -> None:
        self.name = name
        self.body = body
        self.definition = ToolDefinition(
            name=name,
            description=f"test tool {name}",
            parameters={"type": "object", "properties": {"q": {"type": "string"}}},
            timeout_s=timeout_s,
            idempotent=idempotent,
        )
        self.announce_enabled = announce
        self.bind = bind
        self.in_flight: dict[str, asyncio.Future[ToolCallReply]] = {}
        self.executions: Counter[str] = Counter()
        self.received: list[ToolCallRequest] = []
        self.replies: dict[str, ToolCallReply] = {}
        self.redis = redis_client(redis_url)
        self.instance = f"test-{uuid.uuid4().hex[:8]}"
        self.connection: aio_pika.abc.AbstractRobustConnection | None = None
        self.call_started = asyncio.Event()

    async def start(self) -> None:
        self.connection = await aio_pika.connect_robust(AMQP_URL)
        channel = await self.connection.channel()
        self.channel = channel
        if self.announce_enabled:
            await self.announce()
        if not self.bind:
            return
        exchange = await channel.declare_exchange(
            t.TOOLS_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
        )
        queue = await channel.declare_queue(
            t.tool_queue(self.name), durable=True, arguments={"x-queue-type": "quorum"}
        )
        await queue.bind(exchange, routing_key=self.name)
        await queue.consume(self._on_call)

    async def announce(self) -> None:
        now = time.time()
        announcement = ToolAnnouncement(
            service=self.name,
            instance_id=self.instance,
            tools=(self.definition,),
            announced_at=now,
            expires_at=now + 600,
        )
        await self.redis.hset(keys.tool_registry(), self.instance, encode(announcement))

    async def _on_call(self, message: AbstractIncomingMessage) -> None:
        request = decode(message.body, ToolCallRequest)
        self.received.append(request)
        key = request.context.idempotency_key
        reply = self.replies.get(key)
        if reply is None and key in self.in_flight:
            reply = await self.in_flight[key]  # a duplicate of a call still running: not run twice
        if reply is None:
            future: asyncio.Future[ToolCallReply] = asyncio.get_running_loop().create_future()
            self.in_flight[key] = future
            self.executions[key] += 1
            self.call_started.set()
            try:
                value = await self.body(request)
                reply = (
                    value.model_copy(update={"call_id": request.call_id})
                    if isinstance(value, ToolCallReply)  # a body may answer in full
                    else ToolCallReply(call_id=request.call_id, status="ok", value=value)
                )
            except Exception as exc:
                reply = ToolCallReply(call_id=request.call_id, status="error", error=str(exc))
            self.replies[key] = reply
            future.set_result(reply)
        await self.channel.default_exchange.publish(
            aio_pika.Message(
                encode(reply),
                correlation_id=message.correlation_id,
                headers={t.H_IDEMPOTENCY_KEY: key},
                content_type=t.CONTENT_TYPE,
            ),
            routing_key=message.reply_to or "",
        )
        await message.ack()

    async def stop(self) -> None:
        try:
            await self.redis.hdel(keys.tool_registry(), self.instance)
        except ConnectionError:  # the server restarted under this connection: once more
            await self.redis.hdel(keys.tool_registry(), self.instance)
        if self.connection is not None:
            if self.bind:
                channel = await self.connection.channel()
                await channel.queue_delete(t.tool_queue(self.name))
            await self.connection.close()
        await self.redis.aclose()


class EventRecorder:
    """Every event published on ``loopwire.events`` while it runs."""

    def __init__(self, pattern: str = "#", *, amqp_urls: Sequence[str] = (AMQP_URL,)) -> None:
        self.pattern = pattern
        self.amqp_urls = tuple(amqp_urls)
        self.events: list[Event] = []
        self.headers: list[dict[str, Any]] = []
        self.routing_keys: list[str] = []

    async def start(self) -> None:
        self.connection = await connect(self.amqp_urls, name="loopwire-test-events")
        channel = await self.connection.channel()
        exchange = await channel.declare_exchange(
            t.EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(exchange, routing_key=self.pattern)
        await queue.consume(self._on_event, no_ack=True)

    async def _on_event(self, message: AbstractIncomingMessage) -> None:
        self.events.append(decode(message.body, Event))
        self.headers.append(dict(message.headers or {}))
        self.routing_keys.append(message.routing_key or "")

    def for_turn(self, turn_id: str) -> list[Event]:
        return [e for e in self.events if e.turn_id == turn_id]

    async def wait_for(
        self, predicate: Callable[[list[Event]], bool], timeout: float = 20.0
    ) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.events):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"events not seen in time; got {[e.type for e in self.events]}"
                )
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await self.connection.close()


def assert_valid_transcript(messages: list[Any]) -> None:
    """Every assistant tool call is followed by exactly one tool result with its id, in order."""
    i = 0
    while i < len(messages):
        message = messages[i]
        i += 1
        if message.role != "assistant" or not message.tool_calls:
            assert message.role != "tool", f"tool result without a call at {i - 1}"
            continue
        expected = [call.id for call in message.tool_calls]
        results = [m.tool_call_id for m in messages[i : i + len(expected)]]
        assert all(m.role == "tool" for m in messages[i : i + len(expected)]), (
            f"missing results at {i}"
        )
        assert results == expected, f"results {results} do not match calls {expected}"
        i += len(expected)


async def session_history(session_id: str, redis_url: str = REDIS_URL) -> list[Any]:
    """The session's stored history, as the worker wrote it."""
    from worker.session.store import RedisStore

    redis = redis_client(redis_url)
    try:
        return await RedisStore(redis).history(session_id)
    finally:
        await redis.aclose()


async def step_records(session_id: str, turn_id: str, redis_url: str = REDIS_URL) -> list[Any]:
    """The records of a turn's completed steps, as the worker wrote them (its step list)."""
    from contracts import keys
    from contracts.codec import decode
    from contracts.state import StepExecution

    redis = redis_client(redis_url)
    try:
        items = await redis.lrange(keys.turn_steps(session_id, turn_id), 0, -1)
    finally:
        await redis.aclose()
    return [decode(item, StepExecution) for item in items]


async def duplicate_and_garbage(client: LoopwireClient, handle: TurnHandle) -> None:
    """Publish a copy of a finished turn's request (dropped as a duplicate), then a turn
    message that is not msgpack (dead-lettered as malformed)."""
    await client.publish(handle.request)
    await handle.close()
    await client.channel.default_exchange.publish(
        aio_pika.Message(b"\xc1garbage", headers={t.H_KIND: t.KIND_START}),
        routing_key=t.TURNS_QUEUE,
    )
