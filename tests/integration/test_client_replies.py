"""The publisher client's one reply queue (``contracts.replies``), over the real broker and a
worker: the turns it follows at once each get their own events and result, two handles of one
turn id both get them, a turn's binding goes when its last handle closes, and a connection the
broker drops comes back with the followed turns bound again (once each)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from support_rpc import AMQP_URL, wait_until

from contracts.client import LoopwireClient, TurnHandle, new_id
from contracts.events import Event
from harness import WorkerProcess, close_connection_owning, event_bindings, write_agents
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration


def last_user(body: dict[str, Any]) -> str:
    return str([m for m in body["messages"] if m["role"] == "user"][-1]["content"])


async def events_of(handle: TurnHandle) -> list[Event]:
    return [event async for event in handle.events()]


async def unbound(pattern: str) -> None:
    """Until no queue is bound to the events exchange with ``pattern`` (a closed handle's
    binding is removed behind it)."""

    async def none() -> bool:
        return await asyncio.to_thread(event_bindings, pattern) == 0

    await wait_until(none, timeout=30)


async def test_turns_followed_at_once_share_one_queue_and_each_gets_its_own_events_and_result(
    topology: None, scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    scripted_model.respond_with(lambda body: Reply.text(f"answer to {last_user(body)}", delay=0.2))
    agents = write_agents(tmp_path / "agents.json", [])
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker:
        handles = await asyncio.gather(
            *(client.start_turn("support", f"question {n}") for n in range(6))
        )
        followed = await asyncio.gather(*(events_of(h) for h in handles))
        results = await asyncio.gather(*(h.result(30) for h in handles))
    assert worker.errors() == []
    assert len({h.request.reply_to for h in handles}) == 1  # one queue for all six
    for n, (handle, events, result) in enumerate(zip(handles, followed, results, strict=True)):
        assert result.turn_id == handle.turn_id
        assert result.content == f"answer to question {n}"
        assert {e.turn_id for e in events} == {handle.turn_id}
        assert events[0].type == "turn.accepted"
        assert events[-1].type == "turn.completed"
    replies = await client.reply_queue()
    assert replies.following == 6
    for handle in handles:
        await handle.close()
    assert replies.following == 0
    for handle in handles:
        await unbound(f"*.*.*.{handle.turn_id}")


async def test_two_handles_of_one_turn_both_get_its_result_and_closing_one_leaves_the_other(
    topology: None, scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    scripted_model.respond_with(lambda body: Reply.text("the one answer", delay=1.0))
    agents = write_agents(tmp_path / "agents.json", [])
    turn_id, session_id = new_id(), new_id()
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker:
        first = await client.start_turn("support", "hi", turn_id=turn_id, session_id=session_id)
        second = await client.start_turn("support", "hi", turn_id=turn_id, session_id=session_id)
        pattern = f"*.*.*.{turn_id}"
        await first.close()  # the turn's binding stays: the second handle follows it
        assert await asyncio.to_thread(event_bindings, pattern) == 1
        result = await second.result(30)
        events = await events_of(second)
    assert worker.errors() == []
    assert result.content == "the one answer"
    assert events[-1].type == "turn.completed"
    assert not first.done  # closed before the end: it heard nothing more
    await second.close()
    await unbound(pattern)
    assert len(scripted_model.requests) == 1  # the copy ran nothing


async def test_a_dropped_connection_comes_back_with_the_followed_turn_bound_again_once(
    topology: None, scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    scripted_model.respond_with(lambda body: Reply.text("after the drop", delay=2.0))
    agents = write_agents(tmp_path / "agents.json", [])
    async with (
        WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker,
        LoopwireClient(AMQP_URL, reconnect_s=0.3) as client,
    ):
        handle = await client.start_turn("support", "hi")
        await scripted_model.wait_for_requests(1, timeout=20)
        replies = await client.reply_queue()
        await asyncio.to_thread(close_connection_owning, replies.name)
        # its end is published after the drop: it arrives only if the turn was bound again
        events = await asyncio.wait_for(events_of(handle), 30)
        result = await handle.result(30)
        pattern = f"*.*.*.{handle.turn_id}"
        bound = await asyncio.to_thread(event_bindings, pattern)
        await handle.close()
        await unbound(pattern)
    assert worker.errors() == []
    assert result.content == "after the drop"
    assert events[0].type == "turn.accepted"
    assert events[-1].type == "turn.completed"
    assert bound == 1
