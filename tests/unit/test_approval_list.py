"""The fleet-wide list of calls waiting for a decision (``loopwire approvals``): a call is on it
while it waits, and off it once it is decided or its turn ends, whatever path the turn takes;
no entry outlives its wait's ``until``."""

from __future__ import annotations

import pytest

from contracts.control import TurnDecision
from contracts.tools import ToolCallReply, ToolCallRequest, ToolDefinition
from tests.unit.test_sequencer import (
    Clock,
    approving_rig,
    calls_lookup,
    decide,
    kick,
    request,
    work,
)
from tests.unit.world import Answer, calls, says, tool_results, world
from tests.unit.world import request as world_request
from worker.errors import RetryableError
from worker.loop.ports import ModelRequest
from worker.sequencing.actions import Delay, Step
from worker.testing.memory import MemoryStore


async def listed(store: MemoryStore) -> list[str]:
    return [f"{r.turn_id}:{r.call_id}" for r in await store.approvals()]


def boss_answer(request: ModelRequest) -> object:
    if not tool_results(request):
        return calls(("helper", "find it"))
    return says("helper said: " + tool_results(request)[0])


BOSS = {
    "agents": [
        {"name": "boss", "agents": ["helper"], "approval": ["helper"]},
        {"name": "helper"},
    ]
}
BOSS_ANSWERS: dict[str, Answer] = {
    "boss": boss_answer,  # type: ignore[dict-item]
    "helper": lambda r: says("found"),
}


async def test_a_sub_agent_call_is_off_the_list_once_decided_while_its_child_runs() -> None:
    w = world(BOSS, BOSS_ANSWERS)
    await w.run(world_request("boss", "go"))
    assert await listed(w.store) == ["T1:call_0"]

    decision = TurnDecision(turn_id="T1", session_id="S1", call_id="call_0", decision="approve")
    [step] = await w.sequencer.on_decision(decision)
    # the decided step starts the child and waits for it: the call waits for no one now
    assert isinstance(step, Step)
    parked = await w.sequencer.on_step(step.work)
    assert w.store.states["S1"].execution.wait.kind == "children"  # type: ignore[union-attr]
    assert await listed(w.store) == []

    await w.drive(parked)
    assert w.result("T1").content == "helper said: found"
    assert await listed(w.store) == []


async def test_a_call_is_off_the_list_when_a_retry_finds_its_resume_saved() -> None:
    """The decided turn was saved going on, then its step failed (the tool's reply was lost):
    the retried step finds no wait any more, and the call must not stay listed."""
    rig = approving_rig()
    rig.script(calls_lookup())
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_step(work("t1", 0))
    assert await listed(rig.store) == ["t1:call_1"]
    assert await rig.sequencer.on_decision(decide("call_1")) == [kick("t1")]
    call = rig.tools.call
    lost = [RetryableError("the reply was lost in a broker reconnect")]

    async def losing(request: ToolCallRequest, definition: ToolDefinition) -> ToolCallReply:
        if lost:
            raise lost.pop()
        return await call(request, definition)

    rig.tools.call = losing  # type: ignore[method-assign]
    with pytest.raises(RetryableError):
        await rig.sequencer.on_step(work("t1", 0))
    state = rig.store.states["s1"]
    assert state.execution is not None and state.execution.wait is None  # resumed, saved

    assert await rig.sequencer.on_step(work("t1", 0), redone=True) == [kick("t1", 1)]
    assert await listed(rig.store) == []


async def test_a_parked_turn_that_fails_leaves_nothing_listed() -> None:
    rig = approving_rig()
    rig.script(calls_lookup())
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_step(work("t1", 0))
    assert await listed(rig.store) == ["t1:call_1"]

    ended = await rig.sequencer.fail_turn(work("t1", 0), "step_failed", "it keeps failing")

    assert any(getattr(a, "result", None) for a in ended)
    assert await listed(rig.store) == []


async def test_a_listed_call_expires_with_its_wait() -> None:
    clock = Clock()
    rig = approving_rig(timeout_s=60.0, clock=clock)
    rig.store.wall_clock = clock
    rig.script(calls_lookup())
    await rig.sequencer.on_request(request("t1"))
    [delay] = await rig.sequencer.on_step(work("t1", 0))
    assert isinstance(delay, Delay) and delay.work.wait_until is not None

    clock.now = delay.work.wait_until - 0.5
    assert await listed(rig.store) == ["t1:call_1"]
    clock.now = delay.work.wait_until  # its timeout message is lost: the entry still goes
    assert await listed(rig.store) == []
    assert rig.store.waiting_approvals == {}
