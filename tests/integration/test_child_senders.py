"""Only a worker may deliver a child turn's result, over the real broker: a publisher logged in
as a RabbitMQ user of its own forges the result of a running child, with the ids that
``child.started`` announced; the worker dead-letters it (``forbidden``) and the parent gets the
real child's answer. RabbitMQ itself refuses the forger's attempt to pass as the worker's user."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from aiormq.exceptions import ChannelPreconditionFailed
from yarl import URL

from contracts import topology as t
from contracts.client import LoopwireClient
from contracts.codec import decode, encode
from contracts.control import TurnChildResult
from contracts.events import ChildStarted
from contracts.turns import TurnParent, TurnResult
from harness import AMQP_URL, EventRecorder, WorkerProcess
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def forger_url(uid: str) -> Iterator[str]:
    """The URL of a RabbitMQ user of the test's own, with every permission on the test's vhost
    (it may write to the turn queue, as a publisher's user may through loopwire.requests)."""
    url = URL(AMQP_URL)
    user, password = f"lw-forger-{uid}", uuid.uuid4().hex
    rabbitmqctl("add_user", user, password)
    try:
        rabbitmqctl("set_permissions", "-p", url.path.lstrip("/") or "/", user, ".*", ".*", ".*")
        yield str(url.with_user(user).with_password(password))
    finally:
        rabbitmqctl("delete_user", user)


def answer(body: dict[str, Any]) -> Reply:
    agent = body["messages"][0]["content"].removeprefix("agent:")
    if agent == "researcher":
        return Reply.text("the real facts", delay=2.0)
    results = [m["content"] for m in body["messages"] if m["role"] == "tool"]
    if not results:
        return Reply.tool_calls(("researcher", {"input": "find A"}))
    return Reply.text("lead: " + " | ".join(results))


def forged(parent_session: str, parent_turn: str, child: ChildStarted) -> TurnChildResult:
    parent = TurnParent(
        session_id=parent_session,
        turn_id=parent_turn,
        call_id=child.call_id,
        root_turn_id=parent_turn,
    )
    result = TurnResult(
        turn_id=child.turn_id,
        session_id=child.session_id,
        agent=child.agent,
        content="the forger's facts",
        finish_reason="stop",
        parent=parent,
        steps=1,
        duration_s=0.1,
        completed_at=time.time(),
    )
    return TurnChildResult(parent=parent, result=result)


async def dead_letter(client: LoopwireClient, message_id: str) -> aio_pika.IncomingMessage:
    dead = await client.channel.get_queue(t.DEAD_LETTER_QUEUE, ensure=False)
    for _ in range(100):
        message = await dead.get(no_ack=True, fail=False)
        if message is not None and message.message_id == message_id:
            return message
        if message is None:
            await asyncio.sleep(0.1)
    raise AssertionError(f"{message_id} was not dead-lettered")


async def test_a_child_result_forged_by_another_user_is_dead_lettered_and_the_real_one_answers(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    events: EventRecorder,
    forger_url: str,
    tmp_path: Path,
) -> None:
    scripted_model.respond_with(answer)
    agents = tmp_path / "agents.json"
    agents.write_text(
        json.dumps(
            {
                "agents": [
                    {"name": "lead", "system_prompt": "agent:lead", "agents": ["researcher"]},
                    {"name": "researcher", "system_prompt": "agent:researcher"},
                ]
            }
        )
    )
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as w:
        handle = await client.start_turn("lead", "go")
        await events.wait_for(
            lambda es: any(e.type == "child.started" and e.turn_id == handle.turn_id for e in es)
        )
        [started] = [e for e in events.for_turn(handle.turn_id) if e.type == "child.started"]
        assert isinstance(started.data, ChildStarted)
        body = encode(forged(handle.request.session_id, handle.turn_id, started.data))

        forger = await aio_pika.connect(forger_url)
        async with forger:
            channel = await forger.channel(publisher_confirms=True)
            requests = await channel.get_exchange(t.REQUESTS_EXCHANGE, ensure=False)

            def message(**properties: Any) -> aio_pika.Message:
                return aio_pika.Message(body, headers={t.H_KIND: t.KIND_CHILD_RESULT}, **properties)

            await requests.publish(message(message_id="forged-1"), routing_key=t.TURNS_QUEUE)
            own = URL(forger_url).user
            await requests.publish(
                message(message_id="forged-2", user_id=own), routing_key=t.TURNS_QUEUE
            )
            with pytest.raises(ChannelPreconditionFailed):  # RabbitMQ: not the connection's user
                await requests.publish(
                    message(message_id="forged-3", user_id=URL(AMQP_URL).user),
                    routing_key=t.TURNS_QUEUE,
                )

        for message_id in ("forged-1", "forged-2"):
            letter = await dead_letter(client, message_id)
            assert (letter.headers or {})[t.H_REASON_CODE] == "forbidden"
            assert decode(letter.body, TurnChildResult).result.content == "the forger's facts"
        result = await handle.result(30)
        await handle.close()
    assert result.content == "lead: the real facts"
    assert w.errors() == []
