"""The tenants' own intake queues: one tenant's backlog does not hold up another's turns.

Every worker consumes ``loopwire.turns``, shared by everything that starts or controls a turn.
A tenant that publishes a thousand turns at once puts them all ahead of the next tenant's, and
however fast a worker parks the ones over the tenant's cap (``throttled``), the next tenant's
turn waits for every one of them. So while tenancy is on, each tenant of
``LOOPWIRE_TENANTS__INTAKE`` (by default, each tenant named in ``LOOPWIRE_TENANTS__USERS``)
gets a queue of its own, ``loopwire.turns.tenant.<tenant>``, bound to the intake exchange with
``<tenant>.turns`` (contracts.topology): its publishers' requests queue behind its own work
only. Each worker consumes every intake queue beside ``loopwire.turns``, each with its own
prefetch, so a delivery of one tenant never waits for the queue of another: a turn's start is
bounded by the prefetched work in hand (``LOOPWIRE_PREFETCH`` per queue), not by anybody's
backlog. The client publishes there when it acts for a tenant; what the workers keep no queue
for goes on to ``loopwire.turns``. What a worker publishes itself (steps, retries, child turns,
the turns woken from a tenant's line) keeps going to ``loopwire.turns``.

The queues are declared like ``loopwire.turns`` (quorum, dead-lettered, the same delivery
limit), on the consuming channel, so that a reconnect restores them and their consumers. A
tenant dropped from the configuration keeps its queue: a worker of the new configuration no
longer consumes it, so an operator drains it (a worker that still lists the tenant, until the
queue is empty) before deleting it (docs/tenants.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from contracts import tenancy
from contracts import topology as t
from worker.transport.topology import TURNS_ARGUMENTS


class Intake:
    """The intake queues of ``tenants``, consumed with ``handle`` once started."""

    def __init__(self, tenants: Sequence[str]) -> None:
        self.tenants = tuple(dict.fromkeys(tenants))
        bad = [tenant for tenant in self.tenants if not tenancy.valid(tenant)]
        if bad:
            raise ValueError(f"not a tenant name: {bad[0][:64]!r} (letters, digits, _ and -)")
        self._consuming: list[tuple[AbstractQueue, str]] = []

    async def start(
        self,
        channel: AbstractChannel,
        handle: Callable[[AbstractIncomingMessage], Awaitable[Any]],
    ) -> None:
        if not self.tenants:
            return
        exchange = await channel.declare_exchange(
            t.INTAKE_EXCHANGE,
            aio_pika.ExchangeType.TOPIC,
            durable=True,
            arguments={"alternate-exchange": t.INTAKE_FALLBACK_EXCHANGE},
        )
        for tenant in self.tenants:
            queue = await channel.declare_queue(
                t.intake_queue(tenant), durable=True, arguments=TURNS_ARGUMENTS
            )
            await queue.bind(exchange, routing_key=t.intake_key(tenant))
            self._consuming.append((queue, await queue.consume(handle)))

    async def stop(self) -> None:
        """No new deliveries from the intake queues (those in hand are finished)."""
        consuming, self._consuming = self._consuming, []
        for queue, tag in consuming:
            await queue.cancel(tag)
