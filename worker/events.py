"""Publishes lifecycle events on the ``loopwire.events`` topic exchange (with publisher confirms)."""

from __future__ import annotations

import logging

import aio_pika
from aio_pika.abc import AbstractExchange

from contracts.codec import encode
from contracts.events import Event
from contracts.topology import CONTENT_TYPE

log = logging.getLogger("loopwire.events")


def event_message(event: Event) -> aio_pika.Message:
    return aio_pika.Message(
        encode(event),
        headers=dict(event.headers()),
        content_type=CONTENT_TYPE,
        message_id=event.id,
        type=event.type,
        timestamp=event.time,
        delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
    )


class AmqpEventSink:
    """``EventSink`` over a confirming channel's exchange."""

    def __init__(self, exchange: AbstractExchange) -> None:
        self.exchange = exchange

    async def emit(self, event: Event) -> None:
        await self.exchange.publish(
            event_message(event), routing_key=event.routing_key, mandatory=False
        )
