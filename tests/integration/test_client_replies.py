"""The publisher client's one reply queue (``contracts.replies``), over the real broker and a
worker: the turns it follows at once each get their own events and result, two handles of one
turn id both get them, and a turn's binding goes when its last handle closes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from contracts.client import LoopwireClient, TurnHandle, new_id
from contracts.events import Event
from harness import WorkerProcess, event_bindings, write_agents
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration


def last_user(body: dict[str, Any]) -> str:
    return str([m for m in body["messages"] if m["role"] == "user"][-1]["content"])


async def events_of(handle: TurnHandle) -> list[Event]:
    return [event async for event in handle.events()]


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
    pattern = f"*.*.*.{handles[0].turn_id}"
    assert await asyncio.to_thread(event_bindings, pattern) == 0


async def test_two_handles_of_one_turn_both_get_its_result_and_closing_one_leaves_the_other(
    topology: None, scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    scripted_model.respond_with(lambda body: Reply.text("the one answer", delay=1.0))
    agents = write_agents(tmp_path / "agents.json", [])
    turn_id = new_id()
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker:
        first = await client.start_turn("support", "hi", turn_id=turn_id, session_id="s-twice")
        second = await client.start_turn("support", "hi", turn_id=turn_id, session_id="s-twice")
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
    assert await asyncio.to_thread(event_bindings, pattern) == 0
    assert len(scripted_model.requests) == 1  # the copy ran nothing
