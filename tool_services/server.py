"""One running tool service instance: consume tool calls from RabbitMQ, run them, reply.

Topology (``contracts.topology``): the direct exchange ``loopwire.tools``
(durable) and, per tool, a durable quorum queue ``loopwire.tool.<name>`` bound
with the tool's name as routing key. Declarations are idempotent.

One delivery, start to end (steps 1 to 3 are ``tool_services.resolution``):

1. Undecodable body: log, reply an ``error`` if ``reply_to`` and a usable
   ``correlation_id`` are present, ack. Nothing a caller sends kills the service.
2. Deadline (``context.deadline``) already past: log, ack, do not run, no reply.
3. Under the concurrency semaphore, ``CallStore.claim`` the idempotency key
   (``context.idempotency_key``): a stored reply is sent again; a call running
   elsewhere is awaited (polling for its stored reply until the deadline); an
   orphaned non-idempotent call gets an ``unknown`` reply; otherwise the tool
   runs while its lease is renewed.
4. The reply (msgpack ``ToolCallReply``) is stored, then published to the
   default exchange with routing key ``reply_to``, the request's
   ``correlation_id`` and the ``idempotency-key`` header echoed; only then is
   the request acked. If the connection drops first, the broker redelivers the
   request and the stored reply is sent. A call runs in a task of its own, not
   the delivery's: closing a channel cancels its delivery tasks, and a lost
   connection must not cut a tool off halfway.

Concurrency: channel prefetch = ``concurrency`` (RabbitMQ applies it per
consumer, i.e. per tool) plus one semaphore shared by every tool of the instance.

Shutdown: cancel the consumers, withdraw the announcement, requeue deliveries
that have not started, let running calls finish within ``grace_s``, cancel the
rest (unacked, so redelivered), close the connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from contracts.runtime import amqp
from contracts.runtime.redis_client import check, redis_client
from contracts.topology import CONTENT_TYPE, H_IDEMPOTENCY_KEY, TOOLS_EXCHANGE, tool_queue
from tool_services.calls import CallStore
from tool_services.metrics import ToolServiceMetrics
from tool_services.registry import Announcer
from tool_services.resolution import CallResolver, Verdict
from tool_services.sdk import ToolService
from tool_services.settings import Settings
from tool_services.traced import traced

log = logging.getLogger("loopwire.tool_services")


def new_instance_id(service: str) -> str:
    return f"{service}-{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class ToolServer:
    """Serves one ``ToolService``. ``await start()``, later ``await stop()``."""

    def __init__(
        self,
        service: ToolService,
        settings: Settings,
        *,
        instance_id: str | None = None,
        clock: Callable[[], float] = time.time,
        metrics: ToolServiceMetrics | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self._handle_one = (
            self._handle if tracer is None else traced(tracer, self._handle, service.name)
        )
        if not service.tools and not service.dynamic:
            raise ValueError(f"service {service.name!r} has no tools")
        self.service = service
        self.settings = settings
        self.config = settings.tools
        self.instance_id = instance_id or new_instance_id(service.name)
        self.clock = clock
        self._tasks: set[asyncio.Task[Any]] = set()
        self._consumers: list[tuple[AbstractQueue, str]] = []
        self._stopping = False
        self._redis: Redis | None = None
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._bound: set[str] = set()
        self._tools_changed = asyncio.Event()
        self._sync_task: asyncio.Task[None] | None = None
        self._announcer: Announcer | None = None
        self.metrics = metrics or ToolServiceMetrics(CollectorRegistry(), tools=service.tools)
        self._resolver = CallResolver(service, self.config, clock=clock, metrics=self.metrics)
        self.metrics.track_waiting(lambda: len(self._resolver.queued))
        self.amqp_metrics = amqp.AmqpMetrics(self.metrics.registry)
        """The broker connection's reconnects and connected address."""

    @property
    def waiting_for_slot(self) -> int:
        """Deliveries received but waiting for one of the ``concurrency`` slots."""
        return len(self._resolver.queued)

    async def consuming(self) -> bool:
        """Readiness: consumers registered, the broker connection up, not stopping."""
        connection = self._connection
        return (
            (bool(self._consumers) or self.service.dynamic)
            and not self._stopping
            and connection is not None
            and connection.connected.is_set()
        )

    async def redis_answers(self) -> bool:
        """Readiness: the Redis of the call store answers a PING."""
        return self._redis is not None and bool(await self._redis.ping())

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, declare the topology, announce the tools, start consuming."""
        try:
            await self._start()
        except BaseException:
            await self._close()
            raise

    async def _start(self) -> None:
        self._redis = redis_client(
            self.settings.redis_url,
            cluster=self.settings.redis_cluster,
            max_connections=2 * self.config.concurrency + 16,
            timeout=10,
            tls=self.settings.redis_tls,
        )
        await check(self._redis, self.settings.redis_url)
        calls = CallStore(
            self._redis,
            instance_id=self.instance_id,
            lease_ms=self.config.lease_ms,
            ttl_s=self.config.idempotency_ttl_s,
        )
        self._resolver.bind(calls, self._redis)
        self._connection = await amqp.connect(
            amqp.resolve_urls(self.settings.amqp_url, self.settings.amqp_urls),
            name=self.instance_id,
            reconnect_interval_s=self.config.reconnect_interval_s,
            metrics=self.amqp_metrics,
            tls=self.settings.amqp_tls,
        )
        self._channel = await self._connection.channel(publisher_confirms=True)
        await self._channel.set_qos(prefetch_count=self.config.concurrency)
        self._exchange = await self._channel.declare_exchange(
            TOOLS_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
        )
        await self.service.startup(self.metrics.registry)
        await self._bind_new_tools()
        connection = self._connection
        self._announcer = Announcer(
            self._redis,
            service=self.service.name,
            instance_id=self.instance_id,
            tools=self.service.definitions(),
            interval_s=self.config.announce_interval_s,
            ttl_s=self.config.announce_ttl_s,
            healthy=lambda: connection.connected.is_set(),
            clock=self.clock,
        )
        await self._announcer.start()
        if self.service.dynamic:
            self.service.watch(self._tools_changed.set)
            self._sync_task = asyncio.create_task(self._keep_in_sync(), name="tool-sync")
        log.info(
            "tool service %s (%s) serving %s",
            self.service.name,
            self.instance_id,
            ", ".join(self.service.tools) or "no tools yet",
        )

    async def _bind_new_tools(self) -> None:
        """Declare, bind and consume the queue of every tool not consumed yet (all at start; a
        dynamic service's new ones later). A tool once consumed stays consumed until stop: a
        call for a tool the service dropped is answered, not left waiting in its queue."""
        channel, exchange = self._channel, self._exchange
        assert channel is not None and exchange is not None
        for name in list(self.service.tools):
            if name in self._bound:
                continue
            queue = await channel.declare_queue(
                tool_queue(name), durable=True, arguments={"x-queue-type": "quorum"}
            )
            await queue.bind(exchange, routing_key=name)
            tag = await queue.consume(self._on_message)
            self._consumers.append((queue, tag))
            self._bound.add(name)
            self.metrics.add_tools([name])

    async def _keep_in_sync(self) -> None:
        """A dynamic service's tools changed: bind the new ones, announce the new set at once."""
        while True:
            await self._tools_changed.wait()
            self._tools_changed.clear()
            try:
                await self._bind_new_tools()
                if self._announcer is not None:
                    self._announcer.tools = self.service.definitions()
                    await self._announcer.announce()
            except Exception as exc:  # the heartbeat announces the new set; binding is retried
                log.warning("could not apply the changed tools of %s: %s", self.service.name, exc)
                await asyncio.sleep(self.config.reconnect_interval_s)
                self._tools_changed.set()

    async def stop(self) -> bool:
        """Stop consuming, drain within ``grace_s``; True when every running call finished."""
        if self._stopping:
            return True
        self._stopping = self._resolver.stopping = True
        if self._sync_task is not None:
            self._sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sync_task
        for queue, tag in self._consumers:
            with contextlib.suppress(Exception):
                await queue.cancel(tag)
        self._consumers.clear()
        for task in list(self._resolver.queued):
            task.cancel()
        if self._announcer is not None:
            await self._announcer.stop()
        drained = True
        if self._tasks:
            log.info(
                "draining %d in-flight call(s) for up to %gs", len(self._tasks), self.config.grace_s
            )
            _, pending = await asyncio.wait(set(self._tasks), timeout=self.config.grace_s)
            if pending:
                drained = False
                log.warning(
                    "cancelling %d call(s) still running after the grace period", len(pending)
                )
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        await self._close()
        await self.service.shutdown()
        return drained

    async def _close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.close()
            self._connection = None
            self._channel = None
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()
            self._redis = None

    # -- one delivery ----------------------------------------------------------------------

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        # The call runs in a task of its own: a lost connection closes the channel, which
        # cancels its delivery tasks, and a tool cut off halfway (a note half filed) has no
        # stored reply to answer the redelivery with. The call runs on and stores its reply.
        task = asyncio.create_task(self._handle_one(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await asyncio.shield(task)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        try:
            outcome = await self._resolver.process(message)
            if outcome is Verdict.REQUEUE:
                await message.nack(requeue=True)
                return
            if isinstance(outcome, bytes):
                await self._publish_reply(message, outcome)
            await message.ack()
        except asyncio.CancelledError:
            if self._stopping:  # not started yet, or past the grace period: another instance's
                with contextlib.suppress(Exception):
                    await message.nack(requeue=True)
            raise
        except Exception:
            # Connection lost: the broker redelivers by itself and the stored reply is sent
            # then. Anything else would fail again: drop the delivery instead of looping.
            log.exception(
                "could not reply to call %s; dropping the delivery (the reply is stored, and "
                "a redelivery after a lost connection is answered from it)",
                message.correlation_id,
            )
            with contextlib.suppress(Exception):
                await message.reject(requeue=False)

    async def _publish_reply(self, message: AbstractIncomingMessage, body: bytes) -> None:
        if not message.reply_to:
            log.warning("call %s has no reply_to; reply stored only", message.correlation_id)
            return
        channel = self._channel
        if channel is None:
            raise RuntimeError("the channel is closed")
        headers: dict[str, Any] = {}
        key = (message.headers or {}).get(H_IDEMPOTENCY_KEY)
        if isinstance(key, str | bytes):
            headers[H_IDEMPOTENCY_KEY] = key
        reply = aio_pika.Message(
            body,
            correlation_id=message.correlation_id,
            content_type=CONTENT_TYPE,
            headers=headers,
            delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
        )
        await channel.default_exchange.publish(reply, routing_key=message.reply_to, mandatory=False)
