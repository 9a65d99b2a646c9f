"""Declares loopwire's RabbitMQ topology, idempotently (every worker does it at start)."""

from __future__ import annotations

from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue

from contracts import topology as t

TURNS_ARGUMENTS: dict[str, Any] = {
    "x-queue-type": "quorum",
    "x-dead-letter-exchange": t.DEAD_LETTER_EXCHANGE,
    "x-dead-letter-strategy": "at-least-once",
    "x-overflow": "reject-publish",
    "x-delivery-limit": t.TURN_DELIVERY_LIMIT,
}
SESSIONS_ARGUMENTS: dict[str, Any] = {
    "x-queue-type": "quorum",
    "x-dead-letter-exchange": t.DEAD_LETTER_EXCHANGE,
    "x-dead-letter-strategy": "at-least-once",
    "x-delivery-limit": t.TURN_DELIVERY_LIMIT,
}
RETRY_ARGUMENTS: dict[str, Any] = {
    "x-queue-type": "quorum",
    "x-dead-letter-exchange": "",
    "x-dead-letter-routing-key": t.TURNS_QUEUE,
    "x-dead-letter-strategy": "at-least-once",
    "x-overflow": "reject-publish",
}


async def declare_intake(channel: AbstractChannel, turns: AbstractQueue) -> AbstractExchange:
    """The tenants' intake exchange, whose unbound keys reach ``turns`` (contracts.topology)."""
    fallback = await channel.declare_exchange(
        t.INTAKE_FALLBACK_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
    )
    await turns.bind(fallback)
    return await channel.declare_exchange(
        t.INTAKE_EXCHANGE,
        aio_pika.ExchangeType.TOPIC,
        durable=True,
        arguments={"alternate-exchange": t.INTAKE_FALLBACK_EXCHANGE},
    )


class Topology:
    """The declared exchanges and queues."""

    def __init__(
        self,
        *,
        turns: AbstractQueue,
        dead: AbstractQueue,
        dead_letter: AbstractExchange,
        tools: AbstractExchange,
        events: AbstractExchange,
    ) -> None:
        self.turns = turns
        self.dead = dead
        self.dead_letter = dead_letter
        self.tools = tools
        self.events = events


async def declare(channel: AbstractChannel) -> Topology:
    dead_letter = await channel.declare_exchange(
        t.DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
    )
    dead = await channel.declare_queue(
        t.DEAD_LETTER_QUEUE, durable=True, arguments={"x-queue-type": "quorum"}
    )
    await dead.bind(dead_letter, routing_key="#")
    turns = await channel.declare_queue(t.TURNS_QUEUE, durable=True, arguments=TURNS_ARGUMENTS)
    sessions = await channel.declare_queue(
        t.SESSIONS_QUEUE, durable=True, arguments=SESSIONS_ARGUMENTS
    )
    requests = await channel.declare_exchange(
        t.REQUESTS_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
    )
    await turns.bind(requests, routing_key=t.TURNS_QUEUE)
    await sessions.bind(requests, routing_key=t.SESSIONS_QUEUE)
    await declare_intake(channel, turns)
    await channel.declare_queue(t.RETRY_QUEUE, durable=True, arguments=RETRY_ARGUMENTS)
    for seconds in t.WAIT_BUCKETS_S:
        await channel.declare_queue(
            t.wait_queue(seconds),
            durable=True,
            arguments={**RETRY_ARGUMENTS, "x-message-ttl": seconds * 1000},
        )
    tools = await channel.declare_exchange(
        t.TOOLS_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
    )
    events = await channel.declare_exchange(
        t.EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
    )
    return Topology(turns=turns, dead=dead, dead_letter=dead_letter, tools=tools, events=events)
