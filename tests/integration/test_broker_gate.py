"""A step whose channel went down never stays unacked on a delivery channel that is still open,
and no step starts while the broker connection is being restored (against the real broker)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

import aio_pika
import pytest
from aio_pika.abc import AbstractExchange, AbstractIncomingMessage, AbstractQueue
from aiormq.exceptions import ChannelInvalidStateError

from contracts import topology as t
from contracts.codec import encode
from contracts.work import StepWork
from harness import AMQP_URL
from worker.loop import EventSink
from worker.sequencing.actions import Action
from worker.sequencing.sequencer import SessionSequencer
from worker.transport.consumer import Consumer
from worker.transport.publish import ConfirmedPublisher


class FailingSteps:
    """Work whose first ``failures`` steps fail the way a publish on a channel that went down fails."""

    def __init__(self, failures: int = 1) -> None:
        self.failures = failures
        self.steps: list[StepWork] = []
        self.handled = asyncio.Event()

    async def on_step(self, work: StepWork, *, redone: bool = False) -> list[Action]:
        self.steps.append(work)
        if len(self.steps) <= self.failures:
            raise ChannelInvalidStateError("<RobustChannel> closed")
        self.handled.set()
        return []


@pytest.fixture
async def work_queue(uid: str) -> AsyncIterator[tuple[AbstractQueue, AbstractExchange]]:
    connection = await aio_pika.connect_robust(AMQP_URL)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(f"lw-test-gate-{uid}")
        yield queue, channel.default_exchange
        await channel.close()  # a message left unacked goes back to the queue
        check = await connection.channel()
        left = await check.declare_queue(queue.name, passive=True)
        assert left.declaration_result.message_count == 0, "a message was left unacked"
        await check.queue_delete(queue.name)
    finally:
        await connection.close()


def consumer_for(work: FailingSteps, exchange: AbstractExchange, up: asyncio.Event) -> Consumer:
    return Consumer(
        work=cast(SessionSequencer, work),
        publisher=ConfirmedPublisher(exchange.channel),
        dead_letters=ConfirmedPublisher(exchange.channel),
        events=cast(EventSink, None),
        busy_retry_s=0.05,
        broker_up=up,
    )


async def publish_step(exchange: AbstractExchange, queue: AbstractQueue, uid: str) -> None:
    work = StepWork(session_id=f"s-{uid}", turn_id=f"t-{uid}", step=1)
    await exchange.publish(
        aio_pika.Message(encode(work), headers={t.H_KIND: t.KIND_STEP}, message_id=f"t-{uid}:1"),
        routing_key=queue.name,
    )


async def test_a_step_whose_channel_went_down_goes_back_to_the_queue(
    work_queue: tuple[AbstractQueue, AbstractExchange], uid: str
) -> None:
    queue, exchange = work_queue
    work = FailingSteps()
    up = asyncio.Event()
    up.set()
    consumer = consumer_for(work, exchange, up)
    deliveries: list[bool] = []

    async def on_message(message: AbstractIncomingMessage) -> None:
        deliveries.append(message.redelivered or False)
        await consumer.handle(message)

    await queue.consume(on_message)
    await publish_step(exchange, queue, uid)
    await asyncio.wait_for(work.handled.wait(), 10)
    assert [s.turn_id for s in work.steps] == [f"t-{uid}", f"t-{uid}"]
    assert deliveries == [False, True]  # the same delivery, returned to the queue and redone


async def test_no_step_starts_until_the_connection_is_whole(
    work_queue: tuple[AbstractQueue, AbstractExchange], uid: str
) -> None:
    queue, exchange = work_queue
    work = FailingSteps(failures=0)
    up = asyncio.Event()  # cleared: the connection is being restored
    consumer = consumer_for(work, exchange, up)
    received = asyncio.Event()

    async def on_message(message: AbstractIncomingMessage) -> None:
        received.set()
        await consumer.handle(message)

    await queue.consume(on_message)
    await publish_step(exchange, queue, uid)
    await asyncio.wait_for(received.wait(), 10)
    await asyncio.sleep(0.3)
    assert work.steps == []
    up.set()
    await asyncio.wait_for(work.handled.wait(), 10)
    assert len(work.steps) == 1
