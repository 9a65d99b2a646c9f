"""Publishes lifecycle events on the ``loopwire.events`` topic exchange (with publisher confirms)."""

from __future__ import annotations

import logging

from aio_pika import DeliveryMode

from contracts.codec import encode
from contracts.events import Event
from contracts.topology import CONTENT_TYPE
from worker.transport.publish import ConfirmedPublisher, properties

log = logging.getLogger("loopwire.events")


class AmqpEventSink:
    """``EventSink`` over a confirming channel (``ConfirmedPublisher`` to the events exchange)."""

    def __init__(self, publisher: ConfirmedPublisher) -> None:
        self.publisher = publisher

    async def emit(self, event: Event) -> None:
        await self.publisher.publish(
            encode(event),
            routing_key=event.routing_key,
            properties=properties(
                content_type=CONTENT_TYPE,
                delivery_mode=DeliveryMode.NOT_PERSISTENT,
                headers=event.headers(),
                message_id=event.id,
                message_type=event.type,
                timestamp=event.time,
            ),
        )
