"""Confirmed publishes on the per-step path: the broker's confirmation, not the socket's drain.

aio-pika's ``Exchange.publish`` has aiormq wait twice for every message: until the connection's
writer task has written the frames to the socket (``drain``) and then for the broker's
confirmation. On a channel with publisher confirms the second wait implies the first, and the
first costs a good part of a publish's CPU (a hand-off to the writer task and back; a step makes
several confirmed publishes). ``ConfirmedPublisher`` publishes through the same aio-pika channel's
underlying aiormq channel without that wait:

- the aiormq channel is looked up per publish (a robust channel gets a new one after a
  reconnect), and a closed channel raises ``ChannelInvalidStateError`` as aio-pika does;
- a nack raises ``DeliveryError`` and an unroutable ``mandatory`` message ``PublishError`` (on a
  channel opened with ``on_return_raises``) — aiormq raises both, as through aio-pika;
- the properties are the ones aio-pika's ``Message`` would send (``properties``), so the wire is
  unchanged.

Back-pressure stays: every caller awaits its confirmation before it publishes again.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Protocol

import aiormq
from aio_pika import DeliveryMode
from aio_pika.abc import AbstractChannel
from aiormq import spec
from aiormq.exceptions import ChannelInvalidStateError


def properties(
    *,
    content_type: str | None,
    delivery_mode: DeliveryMode,
    headers: dict[str, Any] | None = None,
    message_id: str | None = None,
    correlation_id: str | None = None,
    reply_to: str | None = None,
    expiration_ms: int | None = None,
    timestamp: float | None = None,
    message_type: str | None = None,
    user_id: str | None = None,
) -> spec.Basic.Properties:
    """AMQP properties as aio-pika's ``Message`` builds them (headers ``{}`` when none,
    priority 0, expiration in milliseconds as text, timestamp in UTC). ``user_id``: the
    publishing connection's own user (RabbitMQ refuses any other), which the receiver may
    trust."""
    return spec.Basic.Properties(
        content_type=content_type,
        delivery_mode=delivery_mode,
        headers=headers or {},
        priority=0,
        message_id=message_id,
        correlation_id=correlation_id,
        reply_to=reply_to,
        expiration=None if expiration_ms is None else str(expiration_ms),
        timestamp=None if timestamp is None else datetime.fromtimestamp(timestamp, UTC),
        message_type=message_type,
        user_id=user_id,
    )


class Publisher(Protocol):
    async def publish(
        self,
        body: bytes,
        *,
        routing_key: str,
        properties: spec.Basic.Properties,
        mandatory: bool = False,
    ) -> None:
        """Publish and wait for the broker's confirmation."""
        ...


class ConfirmedPublisher:
    """Publishes to one exchange (``""``: the default exchange) on a channel with confirms."""

    def __init__(self, channel: AbstractChannel, exchange: str = "") -> None:
        self.channel = channel
        self.exchange = exchange

    async def publish(
        self,
        body: bytes,
        *,
        routing_key: str,
        properties: spec.Basic.Properties,
        mandatory: bool = False,
    ) -> None:
        """Publish and wait for the broker's confirmation."""
        if self.channel.is_closed:
            raise ChannelInvalidStateError(f"{self.channel!r} closed")
        channel = await self.channel.get_underlay_channel()
        assert isinstance(channel, aiormq.Channel)  # what aio-pika's channels are built on
        await channel.basic_publish(
            body,
            exchange=self.exchange,
            routing_key=routing_key,
            properties=properties,
            mandatory=mandatory,
            # the confirmation comes after the frames were written; without confirms nothing
            # else would hold a publisher back, so then it waits for the socket
            wait=not channel.publisher_confirms,
        )
