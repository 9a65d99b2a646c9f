"""Publishes lifecycle events on the ``loopwire.events`` topic exchange (with publisher confirms).

While tenancy is on, an event's routing key starts with its tenant (``<tenant>.turn.finished.
<agent>.<turn_id>``, ``contracts.tenancy.routed``), so that a tenant's broker user, allowed to
bind only keys that start with its tenant, sees its own events and nobody else's."""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence

from aio_pika import DeliveryMode

from contracts import tenancy
from contracts.codec import encode
from contracts.events import DEFAULT_EVENTS, EVENT_TYPES, Event
from contracts.runtime.tracing import inject
from contracts.topology import CONTENT_TYPE
from worker.loop.ports import EventSink
from worker.transport.publish import ConfirmedPublisher, properties

log = logging.getLogger("loopwire.events")


class AmqpEventSink:
    """``EventSink`` over a confirming channel (``ConfirmedPublisher`` to the events exchange)."""

    def __init__(self, publisher: ConfirmedPublisher, *, traced: bool = False) -> None:
        self.publisher = publisher
        self.traced = traced
        """Each event carries the span current when it was published (W3C ``traceparent``)."""

    async def emit(self, event: Event) -> None:
        headers = event.headers()
        if self.traced:
            inject(headers)
        await self.publisher.publish(
            encode(event),
            routing_key=tenancy.routed(event.routing_key),
            properties=properties(
                content_type=CONTENT_TYPE,
                delivery_mode=DeliveryMode.NOT_PERSISTENT,
                headers=headers,
                message_id=event.id,
                message_type=event.type,
                timestamp=event.time,
            ),
        )


def enabled_events(patterns: Sequence[str] | None) -> frozenset[str]:
    """The event types ``LOOPWIRE_EVENTS`` enables: each pattern (``fnmatch``: ``turn.*``,
    ``*``) names types; none given: every type but the opt-in ones (``DEFAULT_EVENTS``)."""
    if patterns is None:
        return frozenset(DEFAULT_EVENTS)
    return frozenset(t for t in EVENT_TYPES if any(fnmatch.fnmatchcase(t, p) for p in patterns))


class FilteredSink:
    """``EventSink`` that publishes only the enabled event types through ``inner``."""

    def __init__(self, inner: EventSink, enabled: frozenset[str]) -> None:
        self.inner = inner
        self.enabled = enabled

    async def emit(self, event: Event) -> None:
        if event.type in self.enabled:
            await self.inner.emit(event)
