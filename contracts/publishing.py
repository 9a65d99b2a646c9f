"""Where a publisher (the client, the CLI) sends its messages, so that its broker user can be
limited to what a publisher does.

A turn request, a control message (cancel, decision, session deletion) and a session read go
to ``loopwire.requests`` (routing key ``loopwire.turns`` or ``loopwire.sessions``), which the
workers declare and bind. Against workers of a release that does not declare it, the client
uses the default exchange with the same routing keys, as before; a user limited to
``loopwire.requests`` then cannot publish, and is told so by the broker.

A publisher also makes sure ``loopwire.events`` exists before it binds its queue to it (so a
client may start before any worker); a user that may not declare it (configure) relies on the
workers or the broker's definitions having declared it. Each probe runs on a channel of its
own, since a refusal closes the channel it happens on.

While tenancy is on, a publisher's messages say who sent them: ``Vouched`` stamps each with
the user the connection logs in as (``user_id``, which RabbitMQ refuses unless it is that
user) and the tenant the publisher acts for (``x-loopwire-tenant``: a publisher's own tenant,
or, for a trusted user such as the HTTP gateway, the tenant it acts for), and what would go to
``loopwire.turns`` goes to the intake exchange with the tenant's key instead
(``contracts.topology.INTAKE_EXCHANGE``), when the workers have declared it: into the tenant's
own intake queue if the workers keep one for it, else on to ``loopwire.turns``. Only while
that queue has a consumer (``IntakeProbe``, asked again every few seconds): a tenant's queue
that no worker consumes any more (its tenant dropped from the workers' list) is left alone, so
nothing new waits in it for nobody.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange
from aio_pika.exceptions import ChannelClosed

from contracts import tenancy
from contracts import topology as t


async def publishing_exchange(
    connection: AbstractConnection, channel: AbstractChannel
) -> AbstractExchange:
    """The exchange ``channel`` publishes requests on: ``loopwire.requests`` when it exists."""
    await _probe(
        connection,
        lambda probe: probe.declare_exchange(
            t.EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
        ),
    )
    found = await _probe(
        connection, lambda probe: probe.declare_exchange(t.REQUESTS_EXCHANGE, passive=True)
    )
    if found:
        return await channel.get_exchange(t.REQUESTS_EXCHANGE, ensure=False)
    return channel.default_exchange


async def intake_exchange(
    connection: AbstractConnection, channel: AbstractChannel
) -> AbstractExchange | None:
    """The tenants' intake exchange, when the workers have declared it."""
    found = await _probe(
        connection, lambda probe: probe.declare_exchange(t.INTAKE_EXCHANGE, passive=True)
    )
    return await channel.get_exchange(t.INTAKE_EXCHANGE, ensure=False) if found else None


async def _probe(
    connection: AbstractConnection, act: Callable[[AbstractChannel], Awaitable[Any]]
) -> bool:
    """Whether ``act`` succeeds on a channel of its own (not found or refused: False)."""
    probe = await connection.channel(publisher_confirms=False)
    try:
        await act(probe)
        return True
    except ChannelClosed:
        return False
    finally:
        with contextlib.suppress(Exception):
            await probe.close()


INTAKE_RECHECK_S = 5.0
"""How long a publisher trusts what it learnt of its tenant's intake queue."""
INTAKE_ABSENT_RECHECK_S = 60.0
"""How long it trusts that there is no such queue (asking for a queue that does not exist is a
channel error the broker logs: not every few seconds)."""


class IntakeProbe:
    """Whether the tenant's intake queue exists and a worker consumes it (asked on a channel of
    its own when the publisher publishes, at most every ``INTAKE_RECHECK_S``; when there is no
    such queue, every ``INTAKE_ABSENT_RECHECK_S``)."""

    def __init__(self, connection: AbstractConnection, tenant: str) -> None:
        self.connection = connection
        self.tenant = tenant
        self._live = False
        self._until = 0.0

    async def live(self) -> bool:
        now = time.monotonic()
        if now < self._until:
            return self._live
        consumers: list[int] = []

        async def ask(probe: AbstractChannel) -> None:
            queue = await probe.declare_queue(t.intake_queue(self.tenant), passive=True)
            consumers.append(int(queue.declaration_result.consumer_count or 0))

        found = await _probe(self.connection, ask)
        self._live = found and consumers[0] > 0
        self._until = now + (INTAKE_RECHECK_S if found else INTAKE_ABSENT_RECHECK_S)
        return self._live


class Vouched:
    """``exchange``, every message published through it carrying ``user`` as ``user_id`` and
    ``tenant`` in the ``x-loopwire-tenant`` header; work for ``loopwire.turns`` goes through
    ``intake`` (when given) with the tenant's key."""

    def __init__(
        self,
        exchange: AbstractExchange,
        user: str | None,
        tenant: str,
        intake: AbstractExchange | None = None,
        probe: IntakeProbe | None = None,
    ) -> None:
        self.exchange = exchange
        self.user = user
        self.tenant = tenant
        self.intake = intake
        self.probe = probe

    async def publish(self, message: aio_pika.Message, routing_key: str, **options: Any) -> Any:
        if self.user is not None:
            message.user_id = self.user
        message.headers = {**(message.headers or {}), tenancy.H_TENANT: self.tenant}
        if (
            self.intake is not None
            and routing_key == t.TURNS_QUEUE
            and (self.probe is None or await self.probe.live())
        ):
            return await self.intake.publish(message, t.intake_key(self.tenant), **options)
        return await self.exchange.publish(message, routing_key, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.exchange, name)
