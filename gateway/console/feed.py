"""The console's feed: events in, the index kept, every open console page told.

Two legs, both on the broker, so that any number of replicas share the work and each page
hears every change:

1. The replicas share the queue ``loopwire.gateway.console`` (``contracts.topology``), bound
   to every event. It is a classic queue, not a quorum one: events are published transient,
   and a quorum queue would write every event of the fleet to its log; a classic queue keeps
   them in memory (the queue, declared durable, survives a broker restart; the events in it
   do not, as in every other subscriber's queue). Whichever replica takes an event folds it into the index
   (``index.Index.apply``) and publishes what changed, as JSON, to the fanout exchange
   ``loopwire.gateway.console.live``: the turn's row, the event as the timeline keeps it, or a
   streamed answer's text (``message.delta``, which the index does not keep). The queue is
   bounded (the oldest dropped past ``GATEWAY_CONSOLE_MAX``) and outlives the gateways, so
   events published while no gateway runs are indexed when one starts.
2. Each replica binds an exclusive, auto-deleted queue of its own
   (``loopwire.gateway.console.live.<random>``: a name under ``loopwire.``, so the broker
   permissions the gateway's user already has cover it) to that exchange and hands each change
   to the pages it serves (``Hub``), filtered by tenant.

An event that cannot be read is acked and counted, never dead-lettered: this queue is one
observer's copy, the event's other subscribers have theirs, and a replay to the turn queue
would make no sense. Redis being away sends the event back to the queue after a pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from redis.exceptions import RedisError

from contracts import topology as t
from contracts.codec import DecodeError, decode
from contracts.events import Event
from gateway.console.index import Index, record, tenant_of

log = logging.getLogger("loopwire.console")

LIVE_EXCHANGE = "loopwire.gateway.console.live"
HUB_QUEUE_SIZE = 1000
"""Changes one page may have waiting; past it the page is told to load itself again."""


def trace_id(headers: dict[str, Any]) -> str | None:
    """The trace id of the W3C ``traceparent`` an event carries, if any."""
    raw = headers.get("traceparent")
    if isinstance(raw, bytes):
        raw = raw.decode(errors="replace")
    parts = raw.split("-") if isinstance(raw, str) else []
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


class Hub:
    """The pages this replica serves, each with its queue of changes."""

    def __init__(self) -> None:
        self._pages: dict[int, tuple[str, str | None, asyncio.Queue[dict[str, Any]]]] = {}

    @contextlib.contextmanager
    def page(
        self, tenant: str, turn_id: str | None = None
    ) -> Iterator[asyncio.Queue[dict[str, Any]]]:
        """A queue of the tenant's changes (only one turn's, with ``turn_id``) while open."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(HUB_QUEUE_SIZE)
        self._pages[id(queue)] = (tenant, turn_id, queue)
        try:
            yield queue
        finally:
            self._pages.pop(id(queue), None)

    def tell(self, change: dict[str, Any]) -> None:
        tenant, turn_id = change.get("tenant"), change.get("turn_id")
        for wanted, only, queue in list(self._pages.values()):
            if wanted != tenant or (only is not None and only not in (turn_id, change.get("root"))):
                continue
            try:
                queue.put_nowait(change)
            except asyncio.QueueFull:  # a page that cannot keep up reloads what it shows
                queue.get_nowait()
                queue.put_nowait({"kind": "reload", "tenant": tenant})

    @property
    def open(self) -> int:
        return len(self._pages)


class Feed:
    def __init__(self, index: Index, hub: Hub) -> None:
        self.index = index
        self.hub = hub
        self.unreadable = 0
        self.ready = asyncio.Event()
        """Set once both queues are bound and consumed: the gateway is ready only then, so that
        no event published after a replica said it was ready misses the index."""
        self._live: aio_pika.abc.AbstractExchange | None = None

    async def serve(self, connection: AbstractRobustConnection) -> None:
        """Index events and tell this replica's pages, until cancelled."""
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=64)
        self._live = await channel.declare_exchange(
            LIVE_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
        )
        mine = await channel.declare_queue(
            f"{LIVE_EXCHANGE}.{uuid.uuid4().hex[:12]}", exclusive=True, auto_delete=True
        )
        await mine.bind(self._live, routing_key="")
        await mine.consume(self._on_change, no_ack=True)
        shared = await channel.declare_queue(
            t.GATEWAY_CONSOLE_QUEUE,
            durable=True,
            arguments={"x-max-length": t.GATEWAY_CONSOLE_MAX, "x-overflow": "drop-head"},
        )
        await shared.bind(t.EVENTS_EXCHANGE, routing_key="#")
        await shared.consume(self._on_event)
        self.ready.set()
        await asyncio.Future()  # until cancelled

    async def _on_event(self, message: AbstractIncomingMessage) -> None:
        try:
            event = decode(message.body, Event)
        except DecodeError as exc:
            self.unreadable += 1
            log.warning("an event the console cannot read (%s): dropped", exc.reason)
            await message.ack()
            return
        tenant = tenant_of(message.routing_key or "")
        try:
            change = await self._change(tenant, event, dict(message.headers or {}))
        except (RedisError, ConnectionError) as exc:
            log.warning("the console's index is unreachable, the event goes back: %s", exc)
            await asyncio.sleep(1)
            await message.nack(requeue=True)
            return
        if change is not None and self._live is not None:
            body = json.dumps(change, default=str).encode()
            await self._live.publish(aio_pika.Message(body), routing_key="")
        await message.ack()

    async def _change(
        self, tenant: str, event: Event, headers: dict[str, Any]
    ) -> dict[str, Any] | None:
        base = {"tenant": tenant, "turn_id": event.turn_id, "root": event.root_turn_id}
        if event.type == "message.delta":
            data = event.data.model_dump(mode="json")
            return {**base, "kind": "delta", "step": event.step, **data}
        row = await self.index.apply(tenant, event, trace_id(headers))
        if row is None:
            return None
        return {**base, "kind": "row", "row": row.public(), "event": record(event)}

    async def _on_change(self, message: AbstractIncomingMessage) -> None:
        try:
            change = json.loads(message.body)
        except ValueError:
            return
        if isinstance(change, dict):
            self.hub.tell(change)
