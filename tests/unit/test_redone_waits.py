"""A parked turn's step woken by its own timeout message (an approval's timeout, a throttled
turn's slot), done and then handled again: the worker was killed after the save, or Redis
failed after it (the delivery comes back). The redone wake behaves like any redone step: the
next step is published again, or the finished turn's reply, end and next turn go out again.
And a step message that is not a redelivery (a second wake, a late timeout) repeats nothing."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from contracts.control import TurnCancel
from contracts.turns import LimitOverrides
from contracts.work import StepWork
from tests.unit.test_sequencer import (
    SESSION,
    Clock,
    Rig,
    SlotLimiter,
    answers,
    approving_rig,
    calls_lookup,
    codes,
    decide,
    kick,
    request,
    two_lookups,
    work,
)
from tests.unit.world import calls, world
from tests.unit.world import request as world_request
from worker.loop import Loop
from worker.profiles.agents import AgentProfile, AgentProfiles
from worker.sequencing.actions import Action, Control, Delay, Reply, Step
from worker.sequencing.sequencer import SessionSequencer
from worker.session.leases import LeaseKeeper
from worker.session.port import StepSession
from worker.testing.broker import ScriptedAnswers
from worker.testing.memory import FunctionTools, ListSink, MemoryStore, StaticCatalog


def replies(actions: list[Any]) -> list[Reply]:
    return [a for a in actions if isinstance(a, Reply)]


async def timed_out_wake(rig: Rig, clock: Clock, *, limits: LimitOverrides | None = None) -> Delay:
    """Turn t1 parked for approval of call_1 (t2 queued behind it); the clock at its timeout."""
    rig.script(calls_lookup("Let me look."))
    first = request("t1")
    if limits is not None:
        first = first.model_copy(update={"limits": limits})
    await rig.sequencer.on_request(first)
    await rig.sequencer.on_request(request("t2"))
    [delay] = await rig.sequencer.on_step(work("t1", 0))
    assert isinstance(delay, Delay) and delay.work.wait_until is not None
    clock.now = delay.work.wait_until
    return delay


async def test_a_timeout_wake_redone_after_its_save_publishes_the_next_step_again() -> None:
    clock = Clock()
    rig = approving_rig(clock=clock)
    delay = await timed_out_wake(rig, clock)

    # the worker saved the step woken by the timeout, then was killed before publishing
    assert await rig.sequencer.on_step(delay.work) == [kick("t1", 1)]
    again = await rig.sequencer.on_step(delay.work, redone=True)

    assert again == [kick("t1", 1)]  # a plain step message, no timeout
    rig.script(answers("Nobody answered."))
    ended = await rig.sequencer.on_step(work("t1", 1))
    assert [r.result.content for r in replies(ended)] == ["Nobody answered."]
    assert kick("t2") in ended
    assert rig.tools.calls == []


async def test_a_timeout_wake_whose_redis_failed_after_the_save_goes_on_when_retried() -> None:
    clock = Clock()
    rig = approving_rig(clock=clock)
    delay = await timed_out_wake(rig, clock)
    clear = rig.store.clear_approvals
    failures = [RedisConnectionError("Connection reset by peer")]

    async def flaky_clear(turn_id: str, call_ids: Any) -> None:
        saved = rig.store.states[SESSION].execution
        if failures and saved is not None and saved.step_count:  # Redis fails after the step's save
            raise failures.pop()
        await clear(turn_id, call_ids)

    rig.store.clear_approvals = flaky_clear  # type: ignore[method-assign]

    with pytest.raises(RedisConnectionError):
        await rig.sequencer.on_step(delay.work)
    state = rig.store.states[SESSION]
    assert state.execution is not None and state.execution.step_count == 1  # saved

    assert await rig.sequencer.on_step(delay.work, redone=True) == [kick("t1", 1)]
    rig.script(answers("Nobody answered."), answers("Second turn."))
    ended = await rig.sequencer.on_step(work("t1", 1))
    assert [r.result.content for r in replies(ended)] == ["Nobody answered."]
    assert await rig.sequencer.on_step(work("t2", 0)) == [
        Reply("client.replies", rig.store.results[SESSION, "t2"])
    ]
    assert await rig.store.approvals() == []


async def test_a_timeout_wake_that_ended_its_turn_repeats_the_end_when_redone() -> None:
    clock = Clock()
    rig = approving_rig(clock=clock)
    # one iteration: the step the timeout wakes ends the turn (max_iterations)
    delay = await timed_out_wake(rig, clock, limits=LimitOverrides(max_tool_iterations=1))

    ended = await rig.sequencer.on_step(delay.work)  # its reply and kick are lost
    [result] = [r.result for r in replies(ended)]
    assert result.finish_reason == "max_iterations"
    again = await rig.sequencer.on_step(delay.work, redone=True)

    assert replies(again) == [Reply("client.replies", result)]
    assert kick("t2") in again
    assert codes(again) == ["finished_turn"]
    ends = [e for e in rig.events.events if e.type == "turn.completed" and e.turn_id == "t1"]
    assert len(ends) == 2 and ends[0].id == ends[1].id
    # a later copy of the timeout message that is no redelivery repeats nothing
    assert codes(await rig.sequencer.on_step(delay.work)) == ["stale_step"]


def throttled(model: ScriptedAnswers, limiter: SlotLimiter, clock: Clock) -> SessionSequencer:
    store = MemoryStore()

    def loop_factory(session: StepSession, _profile: AgentProfile, redone: bool) -> Loop:
        return Loop(
            model=model,
            tools=FunctionTools({}),
            catalog=StaticCatalog([]),
            store=session,
            events=ListSink(),
            limiter=limiter,
            clock=clock,
        )

    return SessionSequencer(
        store=store,
        leases=LeaseKeeper(store),
        profiles=AgentProfiles(agents=(AgentProfile(name="support"),)),
        loop_factory=loop_factory,
        events=ListSink(),
        clock=clock,
    )


async def test_a_throttled_turn_woken_by_its_slot_repeats_its_end_when_redone() -> None:
    clock = Clock()
    limiter = SlotLimiter(0.0)
    limiter.open_at = clock.now + 30  # SlotLimiter reads the wall clock: 30 s off
    model = ScriptedAnswers([answers("Finally.")])
    sequencer = throttled(model, limiter, clock)
    await sequencer.on_request(request("t1"))
    await sequencer.on_request(request("t2"))
    [delay] = await sequencer.on_step(work("t1", 0))
    assert isinstance(delay, Delay) and delay.work.wait_until is not None
    clock.now = delay.work.wait_until
    limiter.open_at = 0.0

    ended = await sequencer.on_step(delay.work)
    again = await sequencer.on_step(delay.work, redone=True)

    assert [r.result.content for r in replies(ended)] == ["Finally."]
    assert replies(again) == replies(ended)
    assert kick("t2") in again
    model.assert_done()


async def test_a_parent_woken_at_its_deadline_repeats_its_end_when_redone() -> None:
    """A parent waits for a child that never answers; its children wait's timeout (the turn's
    deadline) ends it. Redone, that wake sends the reply again."""
    clock = Clock()
    team = {"agents": [{"name": "lead", "agents": ["helper"]}, {"name": "helper"}]}
    w = world(team, {"lead": lambda r: calls(("helper", "find it"))}, clock=clock)
    deadline = clock.now + 30
    await w.sequencer.on_request(world_request("lead", "go", deadline=deadline))
    parked = await w.sequencer.on_step(StepWork(session_id="S1", turn_id="T1", step=0))
    [delay] = [a for a in parked if isinstance(a, Delay)]
    assert delay.work.wait_until == deadline
    clock.now = deadline

    # the child is never run: at the deadline the parent stops waiting for it (the child is
    # cancelled, its call answered with an error) and the step it wakes ends the turn
    woken = await w.sequencer.on_step(delay.work)
    assert any(isinstance(a, Control) and isinstance(a.message, TurnCancel) for a in woken)
    [wake] = [a for a in woken if isinstance(a, Step)]
    ended = await w.sequencer.on_step(wake.work)
    again = await w.sequencer.on_step(wake.work, redone=True)

    [result] = [r.result for r in replies(ended)]
    assert (result.finish_reason, result.stopped_by) == ("cancelled", "deadline")
    assert replies(again) == replies(ended)


async def drive(rig: Rig, actions: list[Action]) -> list[Reply]:
    """Perform the step messages as the transport would, in order; the replies sent."""
    todo: deque[Action] = deque(actions)
    sent: list[Reply] = []
    while todo:
        action = todo.popleft()
        if isinstance(action, Reply):
            sent.append(action)
        elif isinstance(action, Step):
            todo.extend(await rig.sequencer.on_step(action.work))
    return sent


async def test_two_decisions_recorded_together_make_one_reply() -> None:
    """Both decisions find the turn parked and each publishes a wake: the first runs the step,
    the second is no redelivery and finds the step done, so it publishes nothing more."""
    rig = approving_rig()
    rig.script(two_lookups())
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_step(work("t1", 0))
    wakes = await rig.sequencer.on_decision(decide("call_1"))
    wakes += await rig.sequencer.on_decision(decide("call_2"))
    assert wakes == [kick("t1"), kick("t1")]
    rig.script(answers("Both done."))

    sent = await drive(rig, wakes)

    assert [r.result.content for r in sent] == ["Both done."]
    assert len(rig.tools.calls) == 2
    assert len([e for e in rig.events.events if e.type == "turn.completed"]) == 1


async def test_a_late_timeout_of_a_decided_wait_repeats_nothing() -> None:
    """The wait was decided and the turn ended at the step it parked at; its timeout message
    comes back later (no redelivery): nothing is published again."""
    rig = approving_rig()
    rig.script(calls_lookup())
    limited = request("t1").model_copy(update={"limits": LimitOverrides(max_tool_iterations=1)})
    await rig.sequencer.on_request(limited)
    [delay] = await rig.sequencer.on_step(work("t1", 0))
    assert isinstance(delay, Delay)
    await rig.sequencer.on_decision(decide("call_1"))
    ended = await rig.sequencer.on_step(work("t1", 0))
    assert len(replies(ended)) == 1

    late = await rig.sequencer.on_step(delay.work)

    assert replies(late) == [] and codes(late) == ["stale_step"]


async def test_children_given_up_on_are_cancelled_when_the_timeout_is_redone() -> None:
    """A parent stops waiting for a child at its children_timeout_s: the child's error is
    recorded, and the worker dies before it publishes the child's cancel and the parent's wake.
    The timeout message comes back: the child is cancelled and the parent woken all the same."""
    clock = Clock()
    team = {
        "agents": [
            {"name": "lead", "agents": ["helper"], "children_timeout_s": 60},
            {"name": "helper"},
        ]
    }
    w = world(team, {"lead": lambda r: calls(("helper", "find it"))}, clock=clock)
    await w.sequencer.on_request(world_request("lead", "go"))
    parked = await w.sequencer.on_step(StepWork(session_id="S1", turn_id="T1", step=0))
    [delay] = [a for a in parked if isinstance(a, Delay)]
    clock.now = delay.work.wait_until or clock.now

    first = await w.sequencer.on_step(delay.work)  # recorded; what it returns is lost
    again = await w.sequencer.on_step(delay.work, redone=True)

    def cancels(actions: list[Action]) -> list[str]:
        return [
            a.message.turn_id
            for a in actions
            if isinstance(a, Control) and isinstance(a.message, TurnCancel)
        ]

    assert cancels(first) and cancels(again) == cancels(first)
    assert any(isinstance(a, Step) and a.work.wait_until is None for a in again)
