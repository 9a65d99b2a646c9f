"""A publisher that knows only the wire protocol (aio-pika and msgpack, none of loopwire's code)
is never left waiting for a request the workers refuse: the rejection comes to its reply queue,
and ``turn.rejected`` is announced for the turn it named, also when the body cannot be read."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aio_pika
import msgpack
import pytest
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue, AbstractRobustConnection

from harness import AMQP_URL, WorkerProcess, write_agents
from worker.testing.scripted_model import ScriptedModel

pytestmark = pytest.mark.integration

FOUR_MIB = 4 * 1024 * 1024


@pytest.fixture
async def connection(topology: None) -> AsyncIterator[AbstractRobustConnection]:
    connection = await aio_pika.connect_robust(AMQP_URL)
    async with connection:
        yield connection


@pytest.fixture
async def worker(scripted_model: ScriptedModel, tmp_path: Path) -> AsyncIterator[WorkerProcess]:
    agents = write_agents(tmp_path / "agents.json", [])
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as process:
        yield process
    assert process.errors() == []


async def first(queue: AbstractQueue, timeout: float = 20) -> AbstractIncomingMessage:
    """The first message on ``queue``, waited for (never polled on a guess)."""
    async with queue.iterator(no_ack=True, timeout=timeout) as messages:
        async for message in messages:
            return message
    raise AssertionError(f"nothing arrived on {queue.name}")


async def reply_and_event_queues(
    connection: AbstractRobustConnection, turn_id: str
) -> tuple[aio_pika.abc.AbstractChannel, AbstractQueue, AbstractQueue]:
    channel = await connection.channel(publisher_confirms=True)
    replies = await channel.declare_queue(f"raw-replies.{turn_id}", exclusive=True)
    events = await channel.declare_queue(exclusive=True)
    await events.bind("loopwire.events", routing_key=f"*.*.*.{turn_id}")
    return channel, replies, events


async def test_a_refused_request_is_answered_on_its_reply_to(
    connection: AbstractRobustConnection, worker: WorkerProcess
) -> None:
    turn_id = f"t-{uuid.uuid4().hex}"
    channel, replies, events = await reply_and_event_queues(connection, turn_id)
    request = {
        "schema_version": 1,
        "turn_id": turn_id,
        "session_id": f"s-{uuid.uuid4().hex}",
        "agent": "nobody",
        "input": [{"role": "user", "content": "hi"}],
        "reply_to": replies.name,
    }
    requests = await channel.get_exchange("loopwire.requests")

    await requests.publish(
        aio_pika.Message(
            msgpack.packb(request),
            content_type="application/msgpack",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=turn_id,
            headers={"x-loopwire-kind": "turn.start"},
        ),
        routing_key="loopwire.turns",
    )

    reply = await first(replies)
    assert (reply.type, reply.correlation_id) == ("turn.rejection", turn_id)
    rejection = msgpack.unpackb(reply.body)
    assert (rejection["turn_id"], rejection["code"]) == (turn_id, "unknown_agent")
    assert "nobody" in rejection["reason"]
    event = msgpack.unpackb((await first(events)).body)
    assert (event["type"], event["data"]["code"]) == ("turn.rejected", "unknown_agent")


async def test_an_oversize_request_named_by_its_properties_is_announced_and_answered(
    connection: AbstractRobustConnection, worker: WorkerProcess
) -> None:
    turn_id = f"t-{uuid.uuid4().hex}"
    channel, replies, events = await reply_and_event_queues(connection, turn_id)
    requests = await channel.get_exchange("loopwire.requests")

    await requests.publish(
        aio_pika.Message(
            b"\x00" * (FOUR_MIB + 1),
            content_type="application/msgpack",
            message_id=turn_id,  # the turn id, as the protocol asks: all that can be read
            reply_to=replies.name,
            headers={"x-loopwire-kind": "turn.start"},
        ),
        routing_key="loopwire.turns",
    )

    reply = await first(replies)
    assert (reply.type, reply.correlation_id) == ("turn.rejection", turn_id)
    assert msgpack.unpackb(reply.body)["code"] == "oversize"
    announced = await first(events)
    assert announced.routing_key == f"turn.rejected._unknown.{turn_id}"
    event = msgpack.unpackb(announced.body)
    assert (event["type"], event["turn_id"], event["data"]["code"]) == (
        "turn.rejected",
        turn_id,
        "oversize",
    )
