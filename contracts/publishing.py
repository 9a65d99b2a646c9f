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
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange
from aio_pika.exceptions import ChannelClosed

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
