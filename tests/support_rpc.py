"""Test support for tool services: an RPC caller written with raw aio-pika, and small helpers.

The caller follows the tool RPC protocol exactly. It publishes ``ToolCallRequest``s on ``loopwire.tools`` (mandatory, on a channel
with publisher confirms that raises on a returned message) and collects every
reply that arrives on its exclusive reply queue, keyed by correlation id.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import subprocess
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
)
from redis.asyncio import Redis

from contracts import keys
from contracts.codec import DecodeError, decode, encode
from contracts.tools import (
    ToolAnnouncement,
    ToolCallReply,
    ToolCallRequest,
    ToolContext,
    idempotency_key,
)
from contracts.topology import H_IDEMPOTENCY_KEY, TOOLS_EXCHANGE
from tool_services.settings import Settings, ToolServiceSettings

TEST_VHOST = "lw_test"
"""The integration tests' own RabbitMQ vhost (created by their setup): they purge queues, so
they never run in a vhost where loopwire may also run."""
TEST_REDIS_DB = 2
"""The integration tests' own Redis database (the benchmark uses 3)."""
AMQP_URL = os.environ.get(
    "LOOPWIRE_TEST_AMQP_URL", f"amqp://guest:guest@127.0.0.1:5672/{TEST_VHOST}"
)
REDIS_URL = os.environ.get("LOOPWIRE_TEST_REDIS_URL", f"redis://127.0.0.1:6379/{TEST_REDIS_DB}")


class RpcCaller:
    def __init__(self, connection: AbstractConnection) -> None:
        self.connection = connection
        self.replies: dict[str, list[ToolCallReply]] = defaultdict(list)
        self.reply_headers: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._arrived = asyncio.Condition()
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self.reply_queue = ""

    async def start(self) -> None:
        self._channel = await self.connection.channel(
            publisher_confirms=True, on_return_raises=True
        )
        self._exchange = await self._channel.declare_exchange(
            TOOLS_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
        )
        queue = await self._channel.declare_queue(exclusive=True, auto_delete=True)
        self.reply_queue = queue.name
        await queue.consume(self._on_reply, no_ack=True)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        reply = decode(message.body, ToolCallReply)
        async with self._arrived:
            self.replies[message.correlation_id or ""].append(reply)
            self.reply_headers[message.correlation_id or ""].append(dict(message.headers or {}))
            self._arrived.notify_all()

    @staticmethod
    def request(
        tool: str,
        arguments: dict[str, Any],
        *,
        turn_id: str,
        call_id: str | None = None,
        session_id: str = "s-test",
        agent: str = "tester",
        deadline_s: float = 10.0,
        deadline: float | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> ToolCallRequest:
        call_id = call_id or f"call_{uuid.uuid4().hex[:12]}"
        return ToolCallRequest(
            call_id=call_id,
            tool=tool,
            arguments=arguments,
            context=ToolContext(
                session_id=session_id,
                turn_id=turn_id,
                agent=agent,
                metadata=metadata or {},
                deadline=deadline if deadline is not None else time.time() + deadline_s,
                idempotency_key=idempotency_key(turn_id, call_id),
            ),
        )

    async def send(
        self,
        request: ToolCallRequest,
        *,
        correlation_id: str | None = None,
        body: bytes | None = None,
        expiration_s: float | None = None,
        reply_to: str | None = None,
    ) -> str:
        """Publish ``request`` per the protocol; returns the correlation id used."""
        assert self._exchange is not None, "start() first"
        correlation_id = correlation_id or request.call_id
        if expiration_s is None:
            expiration_s = max(0.001, request.context.deadline - time.time())
        message = aio_pika.Message(
            body if body is not None else encode(request),
            correlation_id=correlation_id,
            reply_to=self.reply_queue if reply_to is None else reply_to or None,
            expiration=expiration_s,
            content_type="application/msgpack",
            headers={H_IDEMPOTENCY_KEY: request.context.idempotency_key},
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await self._exchange.publish(message, routing_key=request.tool, mandatory=True)
        return correlation_id

    async def wait_reply(self, correlation_id: str, *, timeout: float = 10.0) -> ToolCallReply:
        """The first reply for ``correlation_id`` (waiting up to ``timeout``)."""
        async with asyncio.timeout(timeout), self._arrived:
            await self._arrived.wait_for(lambda: bool(self.replies.get(correlation_id)))
            return self.replies[correlation_id][0]

    async def call(
        self, request: ToolCallRequest, *, timeout: float = 10.0, **send: Any
    ) -> ToolCallReply:
        correlation_id = await self.send(request, **send)
        return await self.wait_reply(correlation_id, timeout=timeout)


def service_settings(**tools: Any) -> Settings:
    """Settings for a tool service under test (``tools`` overrides the ``tools`` group)."""
    return Settings(amqp_url=AMQP_URL, redis_url=REDIS_URL, tools=ToolServiceSettings(**tools))


async def announcements(redis: Redis) -> dict[str, ToolAnnouncement]:
    """Instance id → announcement, for every decodable entry of the registry."""
    found: dict[str, ToolAnnouncement] = {}
    entries: dict[Any, Any] = await redis.hgetall(keys.tool_registry())
    for instance, blob in entries.items():
        with contextlib.suppress(DecodeError):
            found[instance.decode()] = decode(blob, ToolAnnouncement)
    return found


async def drop_announcements(redis: Redis, match: Callable[[ToolAnnouncement], bool]) -> None:
    for instance, announcement in (await announcements(redis)).items():
        if match(announcement):
            await redis.hdel(keys.tool_registry(), instance)


async def wait_announced(
    redis: Redis,
    service: str,
    *,
    exclude: set[str] | frozenset[str] = frozenset(),
    timeout: float = 20,
) -> str:
    """The instance id of a (new) instance of ``service`` once it announced itself."""
    async with asyncio.timeout(timeout):
        while True:
            for instance, announcement in (await announcements(redis)).items():
                if announcement.service == service and instance not in exclude:
                    return instance
            await asyncio.sleep(0.05)


async def wait_until(
    predicate: Callable[[], Awaitable[bool] | bool], *, timeout: float = 10
) -> None:
    """Poll ``predicate`` (Redis, the broker, or what a test's process saw) until it holds."""
    async with asyncio.timeout(timeout):
        while True:
            held = predicate()
            if await held if inspect.isawaitable(held) else held:
                return
            await asyncio.sleep(0.02)


def ensure_test_vhost() -> None:
    """The suites' own vhost, created when missing: the tests purge the turn queues, so they
    never share a vhost with a running loopwire. ``LOOPWIRE_TEST_AMQP_URL`` names another
    broker or vhost, set up beforehand."""
    if os.environ.get("LOOPWIRE_TEST_AMQP_URL"):
        return
    ensure_vhost(TEST_VHOST)


def ensure_vhost(vhost: str, user: str = "guest", password: str = "guest") -> None:
    """``vhost`` on the local broker, open to ``user``. One that ``user`` can open already
    needs nothing more (the broker's CLI is not asked: its Erlang distribution may be
    unreachable while AMQP works). Otherwise ``rabbitmqctl`` (as root or the broker's user)
    creates it and grants ``user`` everything in it, tried three times; a vhost that still
    does not open raises ``RuntimeError`` with what the CLI said."""
    url = f"amqp://{user}:{password}@127.0.0.1:5672/{vhost}"
    if _opens(url):
        return
    tool = shutil.which("rabbitmqctl")
    if tool is None:
        raise RuntimeError(f"vhost {vhost} does not open and rabbitmqctl is not installed")
    said = ""
    for attempt in range(3):
        if attempt:
            time.sleep(5)
        try:
            subprocess.run([tool, "-q", "add_vhost", vhost], capture_output=True, timeout=60)
            granted = subprocess.run(
                [tool, "-q", "set_permissions", "-p", vhost, user, ".*", ".*", ".*"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            said = " ".join((granted.stderr or granted.stdout).split())[:400]
        except subprocess.TimeoutExpired:
            said = "rabbitmqctl did not answer within 60 s"
        if _opens(url):
            return
    raise RuntimeError(f"vhost {vhost} could not be set up for {user}: {said}")


def _opens(url: str) -> bool:
    """Whether an AMQP connection to ``url`` opens (within 10 s), on a thread of its own so
    that it works inside or outside a running event loop."""

    async def probe() -> bool:
        try:
            connection = await asyncio.wait_for(aiormq.connect(url), 10)
        except Exception:
            return False
        await connection.close()
        return True

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, probe()).result()
