"""The publisher client's reply queue: one for the client, not one for each turn.

Every turn the client starts names this queue as its ``reply_to`` and binds it to
``loopwire.events`` for the turn's routing keys (``*.*.*.<turn_id>``, within the client's
tenant) before the request is published, so no early event is missed. What arrives is handed
to the turn's handles by turn id: a reply (AMQP ``type`` ``turn.result`` or ``turn.rejection``)
by its ``correlation_id``, the turn id the worker answers with; an event by the last word of
its routing key, the word the binding matched. A message for a turn no handle follows any
more (a late event, a copy's reply) is dropped. A turn's binding is removed when its last
handle closes; two handles of one turn id (a request published again) share it. A turn the
client did not start (another process's, another request's) is watched on the same queue
(``watch``: its events only).

Why one queue: a queue for each turn cost four broker round trips per turn (declare, consume,
cancel, delete) and a queue created and deleted each time, which RabbitMQ advises against
(queue churn); a binding costs one round trip before the request, and one after the turn.

The queue is named by the client (``loopwire-client.<hex>``), exclusive and auto-deleted, on
the client's robust channel: after a reconnect (or the channel's reopening, or its consumer's
recovery) aio-pika declares it again under the same name with its consumer and the bindings
of the turns still followed, and the client publishes each waiting turn's request again
(``LoopwireClient._ask_again``), since what was sent to it while the client was away went
with the old one. aio-pika forgets a binding only when its removal succeeds: one whose
removal failed (the connection lost meanwhile) is removed again once the channel is back,
unless its turn is followed again.

A turn's bind and unbind run in the order they were asked for (one after the other, each once
the channel is restored), in tasks of their own. Closing a handle takes effect at once (it is
handed nothing more) and its turn's binding is removed behind it: once made, when the handle
closed while it was being made; before a new one, when the turn is followed again meanwhile. A
closing client drops what is under way (the queue and its bindings go with the connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from aio_pika.abc import AbstractIncomingMessage, AbstractRobustChannel, AbstractRobustQueue

from contracts import topology as t
from contracts.codec import DecodeError, decode
from contracts.events import Event

REPLY_TYPES = frozenset({"turn.result", "turn.rejection"})


class Follower(Protocol):
    """What follows a turn on the queue: a ``TurnHandle``, or a watcher of its events."""

    @property
    def turn_id(self) -> str: ...

    async def take(self, message: AbstractIncomingMessage) -> None: ...


class _Watcher:
    """A turn's events as they arrive (its replies are its publisher's, not this reader's)."""

    def __init__(self, turn_id: str) -> None:
        self.turn_id = turn_id
        self._events: asyncio.Queue[Event] = asyncio.Queue()

    async def take(self, message: AbstractIncomingMessage) -> None:
        if message.type not in REPLY_TYPES:
            with contextlib.suppress(DecodeError):
                self._events.put_nowait(decode(message.body, Event))

    async def events(self) -> AsyncIterator[Event]:
        while True:
            yield await self._events.get()


@dataclass(slots=True)
class _Followed:
    """A turn followed on the queue: its handles, its binding's key, and that binding (done
    or under way)."""

    key: str
    bound: asyncio.Future[None]
    handles: list[Follower] = field(default_factory=list)


def queue_name() -> str:
    # named, not server-named: a robust connection can re-declare it after a reconnect
    return f"loopwire-client.{uuid.uuid4().hex}"


class ReplyQueue:
    """``open`` it on the client's channel; ``follow`` a turn's handle before its request is
    published, ``leave`` when the handle closes."""

    def __init__(self, channel: AbstractRobustChannel, queue: AbstractRobustQueue) -> None:
        self.channel = channel
        self.queue = queue
        self._turns: dict[str, _Followed] = {}
        self._last: dict[str, asyncio.Future[None]] = {}
        """Each turn's last bind or unbind asked for, while under way."""
        self._under_way: set[asyncio.Future[None]] = set()
        self._stale: set[str] = set()
        """Keys whose unbinding failed: aio-pika binds them again with the queue."""
        self._shut = False

    @classmethod
    async def open(cls, channel: AbstractRobustChannel) -> ReplyQueue:
        queue = await channel.declare_queue(queue_name(), exclusive=True, auto_delete=True)
        replies = cls(channel, queue)
        await queue.consume(replies._deliver, no_ack=True)
        channel.reopen_callbacks.add(replies._unbind_stale)
        return replies

    @property
    def name(self) -> str:
        return self.queue.name

    @property
    def following(self) -> int:
        """How many turns are followed (bound) now."""
        return len(self._turns)

    async def follow(self, handle: Follower, routing_key: str) -> None:
        """``handle`` gets its turn's replies and the events ``routing_key`` matches, from
        before this returns."""
        turn_id = handle.turn_id
        followed = self._turns.get(turn_id)
        if followed is None:
            bound = self._then(turn_id, self._bind, routing_key)
            followed = self._turns[turn_id] = _Followed(routing_key, bound)
        followed.handles.append(handle)
        try:
            await asyncio.shield(followed.bound)
        except BaseException as exc:
            self.leave(handle)
            task = asyncio.current_task()
            if isinstance(exc, asyncio.CancelledError) and not (task and task.cancelling()):
                raise RuntimeError("the client was closed while following a turn") from None
            raise

    def leave(self, handle: Follower) -> None:
        """``handle`` gets nothing more, from now; its turn's binding is removed with its last
        handle, behind (in order with the turn's other changes; a failure is dropped: the
        binding then goes with the connection)."""
        turn_id = handle.turn_id
        followed = self._turns.get(turn_id)
        if followed is None or handle not in followed.handles:
            return
        followed.handles.remove(handle)
        if followed.handles:
            return
        del self._turns[turn_id]
        if not self._shut:
            self._then(turn_id, self._unbind, followed.key)

    def shut(self) -> None:
        """The client is closing: the changes under way are dropped (the queue and its bindings
        go with the connection)."""
        self._shut = True
        for task in list(self._under_way):
            task.cancel()

    def _then(
        self, turn_id: str, change: Callable[[str], Coroutine[Any, Any, None]], key: str
    ) -> asyncio.Future[None]:
        """``change(key)`` once the turn's changes asked for before it are done, in a task of its
        own (its failure is the caller's to see, or is dropped)."""
        if self._shut:
            raise RuntimeError("the client is closed")
        before = self._last.get(turn_id)

        async def run() -> None:
            if before is not None:
                await asyncio.wait({before})  # whatever its outcome
            await self.channel.ready()
            await change(key)

        task = asyncio.ensure_future(run())
        self._last[turn_id] = task
        self._under_way.add(task)

        def done(task: asyncio.Future[None]) -> None:
            self._under_way.discard(task)
            if self._last.get(turn_id) is task:
                del self._last[turn_id]
            if not task.cancelled():
                task.exception()  # seen by whoever awaited it; no "never retrieved"

        task.add_done_callback(done)
        return task

    async def _bind(self, key: str) -> None:
        self._stale.discard(key)
        await self.queue.bind(t.EVENTS_EXCHANGE, key)

    async def _unbind(self, key: str) -> None:
        try:
            await self.queue.unbind(t.EVENTS_EXCHANGE, key)
        except Exception:
            self._stale.add(key)
            raise

    async def _unbind_stale(self, *_: object) -> None:
        """Once the channel is back (its queue and bindings restored, before the client asks
        again): the bindings whose removal failed, removed, directly (never waiting on the
        turns' changes: this runs within the channel's restore)."""
        for key in list(self._stale):
            if self._shut:
                return
            if any(f.key == key for f in self._turns.values()):  # followed again: wanted
                self._stale.discard(key)
                continue
            with contextlib.suppress(Exception):
                await self.queue.unbind(t.EVENTS_EXCHANGE, key)
                self._stale.discard(key)

    @contextlib.asynccontextmanager
    async def watch(self, turn_id: str, routing_key: str) -> AsyncIterator[AsyncIterator[Event]]:
        """The turn's events from now on (bound before this yields), until the block ends."""
        watcher = _Watcher(turn_id)
        await self.follow(watcher, routing_key)
        try:
            yield watcher.events()
        finally:
            self.leave(watcher)

    async def _deliver(self, message: AbstractIncomingMessage) -> None:
        if message.type in REPLY_TYPES:
            turn_id = message.correlation_id or ""
        else:
            turn_id = (message.routing_key or "").rpartition(".")[2]
        followed = self._turns.get(turn_id)
        for handle in tuple(followed.handles) if followed is not None else ():
            await handle.take(message)
