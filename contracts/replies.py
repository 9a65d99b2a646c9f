"""The publisher client's reply queue: one for the client, not one for each turn.

Every turn the client starts names this queue as its ``reply_to`` and binds it to
``loopwire.events`` for the turn's routing keys (``*.*.*.<turn_id>``, within the client's
tenant) before the request is published, so no early event is missed. What arrives is handed
to the turn's handles by turn id: a reply (AMQP ``type`` ``turn.result`` or ``turn.rejection``)
by its ``correlation_id``, the turn id the worker answers with; an event by the last word of
its routing key, the word the binding matched. A message for a turn no handle follows any
more (a late event, a copy's reply) is dropped. A turn's binding is removed when its last
handle closes; two handles of one turn id (a request published again) share it.

Why one queue: a queue for each turn cost four broker round trips per turn (declare, consume,
cancel, delete) and a queue created and deleted each time, which RabbitMQ advises against
(queue churn); a binding costs one round trip before the request, and one after the turn.

The queue is named by the client (``loopwire-client.<hex>``), exclusive and auto-deleted, on
the client's robust channel: after a reconnect it is declared again under the same name with
its consumer and the bindings of the turns still followed, and the client publishes each
waiting turn's request again (``LoopwireClient._ask_again``), since what was sent to it while
the client was away went with the old one.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from contracts import topology as t

if TYPE_CHECKING:
    from contracts.handle import TurnHandle

REPLY_TYPES = frozenset({"turn.result", "turn.rejection"})


def queue_name() -> str:
    # named, not server-named: a robust connection can re-declare it after a reconnect
    return f"loopwire-client.{uuid.uuid4().hex}"


class ReplyQueue:
    """``open`` it on the client's channel; ``follow`` a turn's handle before its request is
    published, ``leave`` when the handle closes."""

    def __init__(self, queue: AbstractQueue) -> None:
        self.queue = queue
        self._handles: dict[str, list[TurnHandle]] = {}
        self._bound: dict[str, asyncio.Future[Any]] = {}
        """Each followed turn's binding (its key's ``bind``, done or under way)."""
        self._keys: dict[str, str] = {}

    @classmethod
    async def open(cls, channel: AbstractChannel) -> ReplyQueue:
        queue = await channel.declare_queue(queue_name(), exclusive=True, auto_delete=True)
        replies = cls(queue)
        await queue.consume(replies._deliver, no_ack=True)
        return replies

    @property
    def name(self) -> str:
        return self.queue.name

    @property
    def following(self) -> int:
        """How many turns are followed (bound) now."""
        return len(self._handles)

    async def follow(self, handle: TurnHandle, routing_key: str) -> None:
        """``handle`` gets its turn's replies and the events ``routing_key`` matches, from
        before this returns."""
        turn_id = handle.turn_id
        handles = self._handles.setdefault(turn_id, [])
        handles.append(handle)
        if turn_id not in self._bound:
            self._keys[turn_id] = routing_key
            binding = self.queue.bind(t.EVENTS_EXCHANGE, routing_key)
            self._bound[turn_id] = asyncio.ensure_future(binding)
        try:
            await asyncio.shield(self._bound[turn_id])
        except BaseException:
            await self.leave(handle)
            raise

    async def leave(self, handle: TurnHandle) -> None:
        """``handle`` gets nothing more; its turn's binding goes with its last handle."""
        turn_id = handle.turn_id
        handles = self._handles.get(turn_id)
        if handles is None or handle not in handles:
            return
        handles.remove(handle)
        if handles:
            return
        del self._handles[turn_id]
        bound = self._bound.pop(turn_id)
        key = self._keys.pop(turn_id)
        try:
            await asyncio.shield(bound)  # a binding still under way is removed once made
        except Exception:
            return  # never made
        await self.queue.unbind(t.EVENTS_EXCHANGE, key)

    async def _deliver(self, message: AbstractIncomingMessage) -> None:
        if message.type in REPLY_TYPES:
            turn_id = message.correlation_id or ""
        else:
            turn_id = (message.routing_key or "").rpartition(".")[2]
        for handle in tuple(self._handles.get(turn_id, ())):
            await handle.take(message)
