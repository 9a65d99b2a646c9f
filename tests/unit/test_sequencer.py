"""``SessionSequencer`` over a ``MemoryStore``, without any transport: the actions it returns
(``Step``, ``Reply``, ``Busy``, ``Drop``), the events it emits and what the session holds."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Iterator
from typing import Any

import pytest

from contracts.codec import encode
from contracts.control import TurnCancel, TurnDecision
from contracts.events import Event, TurnFinished
from contracts.messages import ChatMessage, ToolCall
from contracts.state import ModelResponse
from contracts.tools import ToolContext, ToolDefinition
from contracts.turns import InputMessage, LimitOverrides, TurnRequest, TurnResult
from contracts.work import StepWork
from worker.errors import ModelError
from worker.loop import Hook, HookContext, Loop
from worker.loop.hooks import ToolInvocation
from worker.loop.ports import LoopObserver, ModelRequest
from worker.profiles.agents import AgentProfile, AgentProfiles
from worker.sequencing.actions import Busy, Delay, Drop, Reply, Step
from worker.sequencing.sequencer import SessionSequencer
from worker.session.leases import LeaseKeeper
from worker.session.port import StepSession
from worker.testing.broker import ScriptedAnswers
from worker.testing.memory import FunctionTools, ListSink, MemoryStore, StaticCatalog
from worker.testing.sequencing import sequencer_over

SESSION = "s1"
REPLIES = "client.replies"
LOOKUP = ToolDefinition(
    name="lookup",
    description="Look an order up.",
    parameters={"type": "object", "properties": {"q": {"type": "string"}}},
)


class RecordingHook(Hook):
    """Records the turns it saw start and the results it saw end."""

    name = "recorder"

    def __init__(self) -> None:
        self.started: list[str] = []
        self.ended: list[TurnResult] = []

    async def before_execution(self, ctx: HookContext) -> None:
        assert ctx.state.execution is not None
        self.started.append(ctx.state.execution.turn_id)

    async def after_execution(self, ctx: HookContext, result: TurnResult) -> None:
        self.ended.append(result)


class RecordingObserver(LoopObserver):
    """Records the turns the loop reported started and finished."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.finished: list[TurnResult] = []

    def turn_started(self, agent: str) -> None:
        self.started.append(agent)

    def turn_finished(self, result: TurnResult) -> None:
        self.finished.append(result)


async def lookup(args: dict[str, Any], ctx: ToolContext) -> Any:
    return {"items": [f"order {args.get('q')}: shipped"]}


@dataclasses.dataclass
class Rig:
    store: MemoryStore
    model: ScriptedAnswers
    tools: FunctionTools
    events: ListSink
    hook: RecordingHook
    observer: RecordingObserver
    sequencer: SessionSequencer

    def script(self, *answers: ModelResponse | BaseException) -> None:
        self.model.answers.extend(answers)

    def event_types(self, turn_id: str) -> list[str]:
        return [e.type for e in self.events.events if e.turn_id == turn_id]

    async def lease_is_free(self) -> bool:
        """Whether a worker could take the session now (taking and letting go of it)."""
        session = await self.store.take(SESSION)
        if session is None:
            return False
        await self.store.release(session)
        return True


class Clock:
    """The time of a rig's loops and sequencer, moved on by the test."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def make_rig(agent: AgentProfile | str = "support", clock: Clock | None = None) -> Rig:
    store = MemoryStore()
    model = ScriptedAnswers()
    tools = FunctionTools({"lookup": lookup})
    events = ListSink()
    hook = RecordingHook()
    observer = RecordingObserver()

    sequencer = sequencer_over(
        store,
        model=model,
        tools=tools,
        definitions=[LOOKUP],
        events=events,
        hooks=hook,
        observer=observer,
        agents=[agent],
        clock=clock or time.time,
    )
    return Rig(store, model, tools, events, hook, observer, sequencer)


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = make_rig()
    yield made
    made.model.assert_done()


def request(turn_id: str = "t1", *, reply_to: str | None = REPLIES) -> TurnRequest:
    return TurnRequest(
        turn_id=turn_id,
        session_id=SESSION,
        agent="support",
        input=(InputMessage(content="Where is order 42?"),),
        reply_to=reply_to,
    )


def work(turn_id: str, index: int) -> StepWork:
    return StepWork(session_id=SESSION, turn_id=turn_id, step=index)


def kick(turn_id: str, index: int = 0) -> Step:
    return Step(work(turn_id, index))


def calls_lookup(content: str | None = None) -> ModelResponse:
    call = ToolCall(id="call_1", name="lookup", arguments=json.dumps({"q": "42"}))
    message = ChatMessage(role="assistant", content=content, tool_calls=(call,))
    return ModelResponse(message=message, finish_reason="tool_calls")


def answers(text: str) -> ModelResponse:
    return ModelResponse(message=ChatMessage(role="assistant", content=text))


def codes(actions: list[Any]) -> list[str]:
    return [a.code for a in actions if isinstance(a, Drop)]


# -- on_request -----------------------------------------------------------------------------


async def test_request_to_an_idle_session_starts_its_turn(rig: Rig) -> None:
    actions = await rig.sequencer.on_request(request("t1"))

    assert actions == [kick("t1")]
    assert rig.event_types("t1") == ["turn.accepted"]
    assert rig.store.queues[SESSION] == ["t1"]


async def test_request_behind_an_unfinished_turn_is_queued(rig: Rig) -> None:
    await rig.sequencer.on_request(request("t1"))

    actions = await rig.sequencer.on_request(request("t2"))

    assert actions == []
    assert rig.event_types("t2") == ["turn.accepted"]
    assert rig.store.queues[SESSION] == ["t1", "t2"]


async def test_duplicate_of_the_pending_head_kicks_step_zero_again(rig: Rig) -> None:
    await rig.sequencer.on_request(request("t1"))

    actions = await rig.sequencer.on_request(request("t1"))

    assert actions == [kick("t1")]
    first, second = (e for e in rig.events.events if e.turn_id == "t1")
    assert first.type == second.type == "turn.accepted"
    assert first.id == second.id  # announced again under the same id
    assert rig.store.queues[SESSION] == ["t1"]  # not queued twice


async def test_duplicate_of_a_queued_turn_is_dropped(rig: Rig) -> None:
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_request(request("t2"))

    actions = await rig.sequencer.on_request(request("t2"))

    assert codes(actions) == ["duplicate_request"]
    assert len(actions) == 1
    assert rig.store.queues[SESSION] == ["t1", "t2"]


@pytest.mark.parametrize("reply_to", [REPLIES, None], ids=["reply-to", "no-reply-to"])
async def test_duplicate_of_a_finished_turn_is_answered_with_its_result(
    rig: Rig, reply_to: str | None
) -> None:
    rig.script(answers("Order 42 shipped yesterday."))
    await rig.sequencer.on_request(request("t1", reply_to=reply_to))
    await rig.sequencer.on_step(work("t1", 0))
    result = rig.store.results[SESSION, "t1"]

    actions = await rig.sequencer.on_request(request("t1", reply_to=reply_to))

    replies = [Reply(reply_to, result)] if reply_to else []
    assert actions[:-1] == replies
    assert codes(actions) == ["duplicate_request"]
    assert result.content == "Order 42 shipped yesterday."


# -- on_step ----------------------------------------------------------------------------------


async def test_step_while_another_worker_holds_the_lease_is_busy(rig: Rig) -> None:
    await rig.sequencer.on_request(request("t1"))
    other = await rig.store.take(SESSION)
    assert other is not None

    actions = await rig.sequencer.on_step(work("t1", 0))

    assert actions == [Busy()]
    assert rig.store.leases[SESSION][0] == other.token  # still the other worker's
    assert rig.model.requests == []


async def test_step_calling_a_tool_asks_for_the_next_step(rig: Rig) -> None:
    rig.script(calls_lookup())
    await rig.sequencer.on_request(request("t1"))

    actions = await rig.sequencer.on_step(work("t1", 0))

    assert actions == [kick("t1", 1)]
    assert [c.tool for c in rig.tools.calls] == ["lookup"]
    assert rig.hook.started == ["t1"]
    assert rig.observer.started == ["support"]
    assert await rig.lease_is_free()


async def test_redelivered_saved_step_publishes_the_next_step_again(rig: Rig) -> None:
    rig.script(calls_lookup())
    await rig.sequencer.on_request(request("t1"))
    assert await rig.sequencer.on_step(work("t1", 0)) == [kick("t1", 1)]

    actions = await rig.sequencer.on_step(work("t1", 0), redone=True)

    assert actions == [kick("t1", 1)]
    assert len(rig.model.requests) == 1  # neither the model
    assert len(rig.tools.calls) == 1  # nor the tool was asked again
    assert await rig.lease_is_free()


async def test_a_copy_of_a_saved_step_that_is_no_redelivery_publishes_nothing(rig: Rig) -> None:
    """A second message for a step that was done (e.g. two wakes of a parked turn): the one
    that did the step published the next; this one is dropped, or the copies would multiply."""
    rig.script(calls_lookup(), answers("Shipped."))
    await rig.sequencer.on_request(request("t1"))
    assert await rig.sequencer.on_step(work("t1", 0)) == [kick("t1", 1)]

    assert codes(await rig.sequencer.on_step(work("t1", 0))) == ["stale_step"]
    ended = await rig.sequencer.on_step(work("t1", 1))
    assert replied(ended).content == "Shipped."
    assert codes(await rig.sequencer.on_step(work("t1", 1))) == ["stale_step"]


async def test_stale_step_is_dropped(rig: Rig) -> None:
    rig.script(calls_lookup())
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_step(work("t1", 0))

    actions = await rig.sequencer.on_step(work("t1", 4))

    assert codes(actions) == ["stale_step"]
    assert len(actions) == 1
    assert await rig.lease_is_free()


async def test_last_step_replies_and_kicks_the_next_turn(rig: Rig) -> None:
    rig.script(answers("Order 42 shipped yesterday."))
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_request(request("t2"))

    actions = await rig.sequencer.on_step(work("t1", 0))

    result = rig.store.results[SESSION, "t1"]
    assert actions == [Reply(REPLIES, result), kick("t2")]
    assert (result.finish_reason, result.content) == ("stop", "Order 42 shipped yesterday.")
    assert rig.store.queues[SESSION] == ["t2"]
    assert await rig.lease_is_free()


async def test_redelivered_last_step_of_a_finished_turn_repeats_its_effects(rig: Rig) -> None:
    rig.script(answers("Order 42 shipped yesterday."))
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_request(request("t2"))
    await rig.sequencer.on_step(work("t1", 0))
    result = rig.store.results[SESSION, "t1"]

    actions = await rig.sequencer.on_step(work("t1", 0), redone=True)

    assert actions[:-1] == [Reply(REPLIES, result), kick("t2")]
    assert codes(actions) == ["finished_turn"]
    completed = [e for e in rig.events.events if e.type == "turn.completed"]
    assert len(completed) == 2
    assert completed[0].id == completed[1].id
    assert encode(completed[0]) == encode(completed[1]), "published again, the same bytes"
    assert completed[0].headers() == completed[1].headers()
    assert all(isinstance(e.data, TurnFinished) and e.data.result == result for e in completed)
    assert len(rig.model.requests) == 1
    assert rig.observer.finished == [result]  # the turn ended once
    assert await rig.lease_is_free()


class WireSink(ListSink):
    """One worker's events, as they reach the wire that every worker publishes to; with
    ``pause_at``, the first event of that type waits for ``release`` (the worker is still
    publishing it)."""

    def __init__(self, wire: list[Event], pause_at: str | None = None) -> None:
        super().__init__()
        self.wire = wire
        self.pause_at = pause_at
        self.paused = asyncio.Event()
        self.release = asyncio.Event()

    async def emit(self, event: Event) -> None:
        if event.type == self.pause_at and not self.paused.is_set():
            self.paused.set()
            await self.release.wait()
        await super().emit(event)
        self.wire.append(event)


@pytest.mark.parametrize(
    ("last", "max_steps", "announced_again"),
    [
        ("answer", None, ["step.completed", "turn.completed"]),
        # ended by the iteration cap: its last save stored the step's tool result
        ("tool_call", 1, ["tool.invoked", "step.completed", "turn.completed"]),
    ],
)
async def test_an_end_announced_again_announces_the_last_step_first_the_same_events(
    last: str, max_steps: int | None, announced_again: list[str]
) -> None:
    store, wire = MemoryStore(), list[Event]()
    answer = answers("Order 42 shipped yesterday.") if last == "answer" else calls_lookup()
    model = ScriptedAnswers([answer])
    ending, copy = WireSink(wire, pause_at=announced_again[0]), WireSink(wire)
    tools = FunctionTools({"lookup": lookup})
    one, other = (
        sequencer_over(store, model=model, tools=tools, definitions=[LOOKUP], events=sink)
        for sink in (ending, copy)
    )
    limits = LimitOverrides(max_tool_iterations=max_steps)
    await one.on_request(request("t1").model_copy(update={"limits": limits}))
    last_step = asyncio.create_task(one.on_step(work("t1", 0)))
    await asyncio.wait_for(ending.paused.wait(), 5)  # the end is saved, its events going out

    actions = await other.on_step(work("t1", 0), redone=True)  # its redelivery, at another worker
    ending.release.set()
    await last_step

    assert codes(actions) == ["finished_turn"]
    assert copy.types() == announced_again
    seen: dict[str, Event] = {}  # what a subscriber keeps: the first event of each id
    for event in wire:
        if event.id in seen:
            assert encode(event) == encode(seen[event.id]), "announced again, the same bytes"
        seen.setdefault(event.id, event)
    types = [e.type for e in seen.values() if e.turn_id == "t1"]
    assert types[-len(announced_again) :] == announced_again, "a step after its turn's end"
    assert len(model.requests) == 1


async def test_a_copy_of_a_finished_turns_request_announces_its_last_step_before_its_end() -> None:
    """A publisher's copy of a turn's request, taken while the worker that ended the turn is
    still publishing its last step's events: the copy's worker announces that step again before
    the end, so no subscriber sees a step after its turn's end."""
    store, wire = MemoryStore(), list[Event]()
    model = ScriptedAnswers([answers("Order 42 shipped yesterday.")])
    ending, copy = WireSink(wire, pause_at="step.completed"), WireSink(wire)
    tools = FunctionTools({"lookup": lookup})
    one, other = (
        sequencer_over(store, model=model, tools=tools, definitions=[LOOKUP], events=sink)
        for sink in (ending, copy)
    )
    await one.on_request(request("t1"))
    last_step = asyncio.create_task(one.on_step(work("t1", 0)))
    await asyncio.wait_for(ending.paused.wait(), 5)  # the end is saved, its events going out

    actions = await other.on_request(request("t1"))  # the publisher's copy, at another worker
    ending.release.set()
    await last_step

    assert codes(actions) == ["duplicate_request"]
    assert copy.types() == ["step.completed", "turn.completed"]
    seen: dict[str, Event] = {}
    for event in wire:
        seen.setdefault(event.id, event)
    types = [e.type for e in seen.values() if e.turn_id == "t1"]
    assert types[-2:] == ["step.completed", "turn.completed"], "a step after its turn's end"


# -- fail_turn: the one path that ends a turn -------------------------------------------------------


async def test_fail_turn_ends_a_running_turn_with_an_error(rig: Rig) -> None:
    rig.script(calls_lookup(content="Let me look that up."))
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_request(request("t2"))
    await rig.sequencer.on_step(work("t1", 0))

    actions = await rig.sequencer.fail_turn(work("t1", 1), "step_failed", "step failed 5 times")

    result = rig.store.results[SESSION, "t1"]
    assert actions == [Reply(REPLIES, result), kick("t2")]
    assert result.finish_reason == "error"
    assert result.error is not None
    assert (result.error.code, result.error.message) == ("step_failed", "step failed 5 times")
    assert result.content == "Let me look that up."
    assert result.steps == 1
    assert rig.hook.started == ["t1"]
    assert rig.hook.ended == [result]
    assert rig.observer.finished == [result]
    assert rig.event_types("t1")[-1] == "turn.failed"
    assert rig.store.queues[SESSION] == ["t2"]
    assert SESSION not in rig.store.leases
    assert await rig.lease_is_free()


async def test_fail_turn_ends_a_turn_that_never_started(rig: Rig) -> None:
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_request(request("t2"))

    actions = await rig.sequencer.fail_turn(work("t1", 0), "poison", "delivered 19 times")

    result = rig.store.results[SESSION, "t1"]
    assert actions == [Reply(REPLIES, result), kick("t2")]
    assert result.finish_reason == "error"
    assert result.error is not None and result.error.code == "poison"
    assert (result.content, result.steps) == (None, 0)
    assert rig.hook.started == []  # it never started
    assert rig.hook.ended == [result]
    assert rig.observer.started == []
    assert rig.observer.finished == [result]
    assert rig.event_types("t1") == ["turn.accepted", "turn.failed"]
    assert rig.store.queues[SESSION] == ["t2"]
    assert SESSION not in rig.store.leases
    assert await rig.lease_is_free()
    assert rig.model.requests == []


async def test_fail_turn_while_another_worker_holds_the_lease_is_busy(rig: Rig) -> None:
    await rig.sequencer.on_request(request("t1"))
    other = await rig.store.take(SESSION)
    assert other is not None

    actions = await rig.sequencer.fail_turn(work("t1", 0), "poison", "delivered 19 times")

    assert actions == [Busy()]
    assert (SESSION, "t1") not in rig.store.results
    assert rig.store.leases[SESSION][0] == other.token


async def test_fail_turn_of_a_finished_turn_changes_nothing_and_repeats_its_effects(
    rig: Rig,
) -> None:
    """E.g. this very call ended the turn, then publishing the reply failed and the message
    came back: the reply goes out again, the turn is not ended twice."""
    rig.script(answers("Shipped."))
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_step(work("t1", 0))
    result = rig.store.results[SESSION, "t1"]

    actions = await rig.sequencer.fail_turn(work("t1", 0), "poison", "delivered 19 times")

    assert codes(actions) == ["finished_turn"]
    assert actions[:-1] == [Reply(REPLIES, result)]
    assert rig.store.results[SESSION, "t1"] == result
    assert rig.hook.ended == [result]
    assert await rig.lease_is_free()


async def test_a_finished_turns_effects_are_repeated_while_the_next_turn_runs(rig: Rig) -> None:
    """The worker that ended t1 died before announcing and replying; t2 has started since: a
    redelivered copy, and a copy given up on as poison, repeat t1's reply and leave t2 be."""
    rig.script(answers("Shipped."), calls_lookup(content="Let me look that up."))
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_request(request("t2"))
    await rig.sequencer.on_step(work("t1", 0))
    await rig.sequencer.on_step(work("t2", 0))  # t2's model answered; its tool is out
    result = rig.store.results[SESSION, "t1"]

    for actions in (
        await rig.sequencer.on_step(work("t1", 0), redone=True),
        await rig.sequencer.fail_turn(work("t1", 0), "poison", "delivered 19 times"),
    ):
        assert codes(actions) == ["finished_turn"]
        assert actions[:-1] == [Reply(REPLIES, result)]  # no kick of the running t2
    assert (SESSION, "t2") not in rig.store.results
    state = rig.store.states[SESSION]
    assert state.execution is not None and state.execution.turn_id == "t2"
    assert await rig.lease_is_free()


async def test_a_copy_of_a_turn_not_finished_is_announced_as_the_same_event(rig: Rig) -> None:
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_request(request("t1"))
    accepted = [e for e in rig.events.events if e.type == "turn.accepted"]
    assert len(accepted) == 2
    assert encode(accepted[0]) == encode(accepted[1])


# -- cancel -----------------------------------------------------------------------------------


def cancel(turn_id: str, reason: str = "user left", session: str | None = SESSION) -> TurnCancel:
    return TurnCancel(turn_id=turn_id, session_id=session, reason=reason, by="frontend")


def replied(actions: list[Any]) -> TurnResult:
    [reply] = [a for a in actions if isinstance(a, Reply)]
    assert reply.reply_to == REPLIES
    return reply.result


async def test_cancel_of_a_queued_turn_ends_it_at_once_without_starting_it(rig: Rig) -> None:
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_request(request("t2"))

    actions = await rig.sequencer.on_cancel(cancel("t2"))

    result = replied(actions)
    assert (result.finish_reason, result.stopped_by, result.steps) == ("cancelled", "user left", 0)
    assert rig.store.queues[SESSION] == ["t1"]
    assert rig.event_types("t2") == ["turn.accepted", "turn.cancelled"]
    assert await rig.store.result(SESSION, "t2") == result
    assert rig.hook.started == []  # never started
    # the copy that follows is for a finished turn
    assert codes(await rig.sequencer.on_cancel(cancel("t2"))) == ["finished_turn"]


async def test_cancel_between_steps_ends_the_turn_before_the_next_model_call(rig: Rig) -> None:
    rig.script(calls_lookup("Looking it up."))
    await rig.sequencer.on_request(request("t1"))
    assert await rig.sequencer.on_step(work("t1", 0)) == [kick("t1", 1)]

    actions = await rig.sequencer.on_cancel(cancel("t1", session=None))  # found by turn id
    assert actions == []  # the step message in flight ends it
    ended = await rig.sequencer.on_step(work("t1", 1))

    result = replied(ended)
    assert (result.finish_reason, result.stopped_by) == ("cancelled", "user left")
    assert result.content == "Looking it up."
    assert result.steps == 1
    assert len(rig.model.requests) == 1
    assert rig.event_types("t1")[-1] == "turn.cancelled"
    # a redelivered copy of it finds the turn over (and says so again)
    assert codes(await rig.sequencer.on_step(work("t1", 1), redone=True)) == ["finished_turn"]
    assert await rig.lease_is_free()


async def test_cancel_with_rollback_removes_the_turns_messages_and_the_next_turn_never_sees_them(
    rig: Rig,
) -> None:
    rig.script(answers("Order 42 ships today."))
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_step(work("t1", 0))
    before = list(rig.store.histories[SESSION])
    rig.script(calls_lookup("Looking it up."))
    await rig.sequencer.on_request(request("t2"))
    assert await rig.sequencer.on_step(work("t2", 0)) == [kick("t2", 1)]
    assert len(rig.store.histories[SESSION]) > len(before)  # its input, the call, its result

    rolled_back = cancel("t2").model_copy(update={"rollback": True})
    assert await rig.sequencer.on_cancel(rolled_back) == []
    result = replied(await rig.sequencer.on_step(work("t2", 1)))

    assert (result.finish_reason, result.stopped_by, result.steps) == ("cancelled", "user left", 1)
    assert rig.store.histories[SESSION] == before
    assert rig.store.states[SESSION].history_len == len(before)
    assert len(rig.store.steps[(SESSION, "t2")]) == 1  # its record stays
    rig.script(answers("Anything else?"))
    await rig.sequencer.on_request(request("t3"))
    await rig.sequencer.on_step(work("t3", 0))
    seen = [m.content for m in rig.model.requests[-1].messages]
    assert "Looking it up." not in seen
    assert seen.count("Where is order 42?") == 2  # t1's input and t3's, not t2's
    assert "Order 42 ships today." in seen


async def test_cancel_of_the_head_before_its_first_step_never_calls_the_model(rig: Rig) -> None:
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_request(request("t2"))

    assert await rig.sequencer.on_cancel(cancel("t1")) == []
    actions = await rig.sequencer.on_step(work("t1", 0))  # its first step message

    assert replied(actions).finish_reason == "cancelled"
    assert kick("t2") in actions  # the session's next turn runs
    assert rig.model.requests == []


async def test_cancel_for_an_unknown_or_finished_turn_is_dropped(rig: Rig) -> None:
    rig.script(answers("done"))
    await rig.sequencer.on_request(request("t1"))
    await rig.sequencer.on_step(work("t1", 0))

    assert codes(await rig.sequencer.on_cancel(cancel("t1"))) == ["finished_turn"]
    assert codes(await rig.sequencer.on_cancel(cancel("nope"))) == ["unknown_turn"]
    assert codes(await rig.sequencer.on_cancel(cancel("nope", session=None))) == ["unknown_turn"]


class HangingModel:
    """A model that never answers (until the step is abandoned)."""

    def __init__(self) -> None:
        self.calls = 0
        self.called = asyncio.Event()
        self.abandoned = asyncio.Event()

    def complete(self, request: ModelRequest) -> Awaitable[ModelResponse]:
        self.calls += 1
        self.called.set()
        return self._hang()

    async def _hang(self) -> ModelResponse:
        try:
            await asyncio.Event().wait()
        finally:
            self.abandoned.set()
        raise AssertionError("unreachable")


async def test_cancel_reaches_a_step_waiting_on_the_model_through_its_lease_renewal() -> None:
    store = MemoryStore(lease_ttl_s=0.3)  # renewed every 0.1 s
    model = HangingModel()
    events = ListSink()
    sequencer = sequencer_over(
        store, model=model, tools=FunctionTools({}), definitions=[], events=events
    )
    await sequencer.on_request(request("t1"))
    step = asyncio.create_task(sequencer.on_step(work("t1", 0)))
    await asyncio.wait_for(model.called.wait(), 2)

    assert await sequencer.on_cancel(cancel("t1")) == []
    work_again = kick("t1")
    assert await asyncio.wait_for(step, 2) == [work_again]
    assert model.abandoned.is_set()
    assert not step.cancelled()
    ended = await sequencer.on_step(work_again.work)

    result = replied(ended)
    assert (result.finish_reason, result.stopped_by, result.content) == (
        "cancelled",
        "user left",
        None,
    )
    assert model.calls == 1
    assert [e.type for e in events.events][-1] == "turn.cancelled"


class GatedModel:
    """A model that answers with ``answer`` once the test lets it."""

    def __init__(self, answer: ModelResponse) -> None:
        self.answer = answer
        self.called = asyncio.Event()
        self.go = asyncio.Event()

    def complete(self, request: ModelRequest) -> Awaitable[ModelResponse]:
        self.called.set()
        return self._answer()

    async def _answer(self) -> ModelResponse:
        await self.go.wait()
        return self.answer


async def test_a_cancel_recorded_while_the_model_thinks_stops_the_tools_it_then_asks_for() -> None:
    store = MemoryStore()  # no renewal comes before the model answers
    model = GatedModel(calls_lookup("Let me look."))
    tools = FunctionTools({"lookup": lookup})
    events = ListSink()
    sequencer = sequencer_over(store, model=model, tools=tools, definitions=[LOOKUP], events=events)
    await sequencer.on_request(request("t1"))
    step = asyncio.create_task(sequencer.on_step(work("t1", 0)))
    await asyncio.wait_for(model.called.wait(), 2)
    assert await sequencer.on_cancel(cancel("t1")) == []
    model.go.set()

    actions = await asyncio.wait_for(step, 2)
    assert tools.calls == []
    result = replied(actions)
    assert (result.finish_reason, result.stopped_by, result.content) == (
        "cancelled",
        "user left",
        "Let me look.",
    )
    assert not any(e.type == "tool.invoking" for e in events.events)
    history = store.histories[SESSION]
    assert [m.role for m in history] == ["user", "assistant", "tool"]  # the call, answered
    assert "not run" in (history[-1].content or "")


# -- approval ---------------------------------------------------------------------------------


def approving_rig(timeout_s: float = 3600.0, clock: Clock | None = None) -> Rig:
    return make_rig(
        AgentProfile(name="support", approval=("lookup",), approval_timeout_s=timeout_s), clock
    )


def decide(call_id: str = "call_1", verdict: str = "approve", **fields: Any) -> TurnDecision:
    return TurnDecision(
        turn_id="t1", session_id=SESSION, call_id=call_id, decision=verdict, by="maria", **fields
    )  # type: ignore[arg-type]


def two_lookups() -> ModelResponse:
    calls = tuple(
        ToolCall(id=f"call_{n}", name="lookup", arguments=json.dumps({"q": str(n)})) for n in (1, 2)
    )
    return ModelResponse(
        message=ChatMessage(role="assistant", content=None, tool_calls=calls),
        finish_reason="tool_calls",
    )


def tool_answers(rig: Rig) -> list[str]:
    """What the model was told by the tools, in its last request."""
    return [m.content or "" for m in rig.model.requests[-1].messages if m.role == "tool"]


async def parked_turn(rig: Rig, response: ModelResponse | None = None) -> list[Any]:
    rig.script(response or calls_lookup("Let me look."))
    await rig.sequencer.on_request(request("t1"))
    return await rig.sequencer.on_step(work("t1", 0))


async def test_a_call_that_needs_approval_parks_the_turn_holding_nothing() -> None:
    rig = approving_rig()
    actions = await parked_turn(rig)

    [delay] = actions
    assert isinstance(delay, Delay) and delay.work.wait_until is not None
    assert delay.work.wait_until == pytest.approx(time.time() + 3600, abs=5)
    assert rig.tools.calls == []
    state = rig.store.states[SESSION]
    assert state.execution is not None and state.execution.status == "waiting"
    assert await rig.lease_is_free()
    [requested] = [e for e in rig.events.events if e.type == "approval.requested"]
    assert requested.data.call_id == "call_1" and requested.data.tool == "lookup"  # type: ignore[union-attr]
    [listed] = await rig.store.approvals()
    assert (listed.turn_id, listed.call_id, listed.tool) == ("t1", "call_1", "lookup")
    # a step message for it with nothing new leaves it parked (and announced again, the same)
    again = await rig.sequencer.on_step(work("t1", 0))
    assert [type(a) for a in again] == [Delay]
    assert [e.id for e in rig.events.events if e.type == "approval.requested"] == [requested.id] * 2


async def test_a_tool_whose_definition_asks_for_approval_parks_every_agents_call() -> None:
    """A tool service (an MCP bridge's configuration) may declare that its tool's calls wait
    for a human, whichever agent makes them: the agent need not list it."""
    store, model, events = MemoryStore(), ScriptedAnswers(), ListSink()
    tools = FunctionTools({"lookup": lookup})
    guarded = LOOKUP.model_copy(update={"approval": True})
    sequencer = sequencer_over(
        store, model=model, tools=tools, definitions=[guarded], events=events
    )
    model.answers.extend([calls_lookup("Let me look."), answers("Found it.")])
    await sequencer.on_request(request("t1"))

    [delay] = await sequencer.on_step(work("t1", 0))

    assert isinstance(delay, Delay)
    assert tools.calls == []
    [requested] = [e for e in events.events if e.type == "approval.requested"]
    assert requested.data.tool == "lookup"  # type: ignore[union-attr]
    await store.record_control(SESSION, "t1", "decision:call_1", decide())
    await sequencer.on_step(work("t1", 0))
    assert len(tools.calls) == 1


async def test_a_call_is_listed_as_waiting_before_it_is_announced() -> None:
    """Whoever hears ``approval.requested`` (and a worker may die right after announcing it)
    finds the call on the list ``loopwire approvals`` reads, on the first park and on the
    announcement made again."""
    rig = approving_rig()
    listed_when_heard: list[list[str]] = []
    emit = rig.events.emit

    async def checking(event: Any) -> None:
        if event.type == "approval.requested":
            listed_when_heard.append([r.call_id for r in await rig.store.approvals()])
        await emit(event)

    rig.events.emit = checking  # type: ignore[method-assign]
    await parked_turn(rig, two_lookups())
    await rig.sequencer.on_step(work("t1", 0))  # found parked: announced again
    assert listed_when_heard == [["call_1", "call_2"]] * 4


@pytest.mark.parametrize(
    ("verdict", "fields", "seen", "ran"),
    [
        ("approve", {}, "order 42: shipped", ["42"]),
        ("edit", {"arguments": {"q": "43"}}, "order 43: shipped", ["43"]),
        ("reject", {"message": "not that one"}, "rejected by maria: not that one", []),
    ],
)
async def test_a_decision_resumes_the_parked_turn(
    verdict: str, fields: dict[str, Any], seen: str, ran: list[str]
) -> None:
    rig = approving_rig()
    await parked_turn(rig)
    rig.script(answers("Here you are."))

    assert await rig.sequencer.on_decision(decide("call_1", verdict, **fields)) == [kick("t1")]
    assert await rig.sequencer.on_step(work("t1", 0)) == [kick("t1", 1)]
    ended = await rig.sequencer.on_step(work("t1", 1))

    assert [c.arguments["q"] for c in rig.tools.calls] == ran
    assert seen in tool_answers(rig)[0]
    assert await rig.store.approvals() == []
    assert any(isinstance(a, Reply) and a.result.content == "Here you are." for a in ended)
    [decided] = [e for e in rig.events.events if e.type == "approval.decided"]
    assert decided.data.decision == verdict  # type: ignore[union-attr]
    # the decision is not applied twice, and a second one is dropped
    assert codes(await rig.sequencer.on_decision(decide("call_1"))) == ["finished_turn"]


async def test_calls_of_one_step_wait_together_and_are_decided_one_by_one() -> None:
    rig = approving_rig()
    await parked_turn(rig, two_lookups())

    assert await rig.sequencer.on_decision(decide("call_2")) == [kick("t1")]
    still = await rig.sequencer.on_step(work("t1", 0))
    assert [type(a) for a in still] == [Delay] and rig.tools.calls == []
    assert [r.call_id for r in await rig.store.approvals()] == ["call_1"]
    assert codes(await rig.sequencer.on_decision(decide("call_2", "reject"))) == []  # kicks again
    assert await rig.sequencer.on_decision(decide("call_1", "reject", message="no")) == [kick("t1")]
    rig.script(answers("One of two."))
    assert await rig.sequencer.on_step(work("t1", 0)) == [kick("t1", 1)]
    await rig.sequencer.on_step(work("t1", 1))

    assert [c.arguments["q"] for c in rig.tools.calls] == ["2"], "the first decision counts"
    assert "rejected by maria: no" in tool_answers(rig)[0]


async def test_an_undecided_call_is_rejected_when_the_wait_times_out_and_never_before() -> None:
    clock = Clock()
    rig = approving_rig(timeout_s=3.0, clock=clock)
    [delay] = await parked_turn(rig)
    assert isinstance(delay, Delay) and delay.work.wait_until == clock.now + 3.0
    rig.script(answers("Nobody answered."))

    # back early (the wait queues' delays are whole seconds): it waits the rest
    clock.now += 2.0
    assert await rig.sequencer.on_step(delay.work) == [Delay(delay.work)]
    clock.now = delay.work.wait_until - 0.01
    assert await rig.sequencer.on_step(delay.work) == [Delay(delay.work)]
    assert rig.store.states[SESSION].execution.status == "waiting"  # type: ignore[union-attr]
    clock.now = delay.work.wait_until
    assert await rig.sequencer.on_step(delay.work) == [kick("t1", 1)]
    await rig.sequencer.on_step(work("t1", 1))

    assert rig.tools.calls == []
    assert "rejected by timeout: no decision within 3s" in tool_answers(rig)[0]
    # a copy of the timeout message, later, finds the turn over
    assert codes(await rig.sequencer.on_step(delay.work)) == ["stale_step"]


async def test_an_approval_waits_no_longer_than_the_turns_deadline() -> None:
    """The deadline comes before the approval timeout: the park waits until the deadline,
    and the turn then ends as at any deadline, not as an approval timeout."""
    clock = Clock()
    rig = approving_rig(clock=clock)  # approval_timeout_s 3600
    rig.script(calls_lookup("Let me look."))
    deadline = clock.now + 5.0
    await rig.sequencer.on_request(request("t1").model_copy(update={"deadline": deadline}))

    [delay] = await rig.sequencer.on_step(work("t1", 0))
    assert isinstance(delay, Delay) and delay.work.wait_until == deadline
    [requested] = [e for e in rig.events.events if e.type == "approval.requested"]
    assert requested.data.until == deadline  # type: ignore[union-attr]
    clock.now = deadline
    result = replied(await rig.sequencer.on_step(delay.work))

    assert (result.finish_reason, result.stopped_by) == ("cancelled", "deadline")
    assert rig.tools.calls == []
    assert "approval.decided" not in rig.event_types("t1")
    assert rig.event_types("t1")[-1] == "turn.cancelled"
    tool = rig.store.histories[SESSION][-1]
    assert tool.role == "tool" and "not run: the turn ended (cancelled)" in (tool.content or "")
    assert await rig.store.approvals() == []


async def test_a_decision_recorded_while_the_step_parks_wakes_it_at_once() -> None:
    rig = approving_rig()
    rig.script(calls_lookup())
    await rig.sequencer.on_request(request("t1"))
    # decided before the turn parked (the step that parks it is still running): no step to kick
    assert await rig.sequencer.on_decision(decide("call_1")) == []

    actions = await rig.sequencer.on_step(work("t1", 0))

    assert Step(work("t1", 0)) in actions
    rig.script(answers("Done."))
    assert await rig.sequencer.on_step(work("t1", 0)) == [kick("t1", 1)]
    assert len(rig.tools.calls) == 1


async def test_a_cancel_ends_a_parked_turn_at_once() -> None:
    rig = approving_rig()
    [delay] = await parked_turn(rig)

    assert await rig.sequencer.on_cancel(cancel("t1")) == [kick("t1")]
    ended = await rig.sequencer.on_step(work("t1", 0))

    result = replied(ended)
    assert (result.finish_reason, result.content) == ("cancelled", "Let me look.")
    assert rig.tools.calls == []
    history = rig.store.histories[SESSION]
    assert [m.role for m in history] == ["user", "assistant", "tool"]  # the call got its answer
    assert isinstance(delay, Delay)
    assert codes(await rig.sequencer.on_step(delay.work)) == ["stale_step"]


async def test_a_turn_past_its_deadline_mid_step_is_abandoned_and_ends_as_cancelled() -> None:
    store = MemoryStore()
    model = HangingModel()
    sequencer = sequencer_over(
        store, model=model, tools=FunctionTools({}), definitions=[], events=ListSink()
    )
    late = request("t1").model_copy(update={"deadline": time.time() + 0.3})
    await sequencer.on_request(late)

    again = await asyncio.wait_for(sequencer.on_step(work("t1", 0)), 2)
    assert again == [kick("t1")]
    assert model.abandoned.is_set()
    result = replied(await sequencer.on_step(work("t1", 0)))

    assert (result.finish_reason, result.stopped_by) == ("cancelled", "deadline")
    assert model.calls == 1


# -- throttled ------------------------------------------------------------------------------


class SlotLimiter:
    """Admits a call once ``open_at`` has passed; says how long to wait before."""

    def __init__(self, wait_s: float) -> None:
        self.open_at = time.time() + wait_s
        self.asked = 0

    async def admit(self, messages: Any, max_tokens: int | None) -> float:
        self.asked += 1
        return max(0.0, self.open_at - time.time())


def throttling_rig(
    model: ScriptedAnswers, limiter: SlotLimiter | None = None, events: ListSink | None = None
) -> SessionSequencer:
    store = MemoryStore()
    sink = events if events is not None else ListSink()

    def loop_factory(session: StepSession, _profile: AgentProfile, redone: bool) -> Loop:
        return Loop(
            model=model,
            tools=FunctionTools({"lookup": lookup}),
            catalog=StaticCatalog([LOOKUP]),
            store=session,
            events=sink,
            limiter=limiter,
        )

    return SessionSequencer(
        store=store,
        leases=LeaseKeeper(store),
        profiles=AgentProfiles(agents=(AgentProfile(name="support"),)),
        loop_factory=loop_factory,
        events=ListSink(),
    )


@pytest.mark.parametrize("cause", ["rate_limit", "429"])
async def test_a_throttled_step_parks_its_turn_until_its_slot(cause: str) -> None:
    model = ScriptedAnswers()
    limiter = None
    if cause == "rate_limit":
        limiter = SlotLimiter(1.2)
    else:
        model.answers.append(ModelError("slow down", code="model_http_429", retry_after=1.2))
    model.answers.append(answers("Finally."))
    events = ListSink()
    sequencer = throttling_rig(model, limiter, events)
    await sequencer.on_request(request("t1"))

    [delay] = await sequencer.on_step(work("t1", 0))
    assert isinstance(delay, Delay) and delay.work.wait_until is not None
    assert delay.work.wait_until >= time.time() + 1.0
    [throttled] = [e for e in events.events if e.type == "turn.throttled"]
    assert (throttled.turn_id, throttled.step) == ("t1", 0)
    assert throttled.data.model_dump() == {"until": delay.work.wait_until}
    # any other step message for it sends the timeout again; the model is not asked early
    assert await sequencer.on_step(work("t1", 0)) == [delay]
    assert await sequencer.on_step(delay.work) == [delay], "back early: on through the queues"
    await asyncio.sleep(max(0.0, delay.work.wait_until - time.time() + 0.05))

    result = replied(await sequencer.on_step(delay.work))
    assert result.content == "Finally."
    assert len(model.requests) == (1 if cause == "rate_limit" else 2)
    model.assert_done()


class BigOrders(Hook):
    """Asks a human about lookups of order 42 only."""

    name = "big_orders"

    async def needs_approval(self, ctx: HookContext, call: ToolInvocation) -> bool:
        return call.arguments.get("q") == "42"


async def test_a_hook_may_ask_for_an_approval_the_profile_does_not_require() -> None:
    store, model, tools = MemoryStore(), ScriptedAnswers(), FunctionTools({"lookup": lookup})
    sequencer = sequencer_over(
        store, model=model, tools=tools, definitions=[LOOKUP], events=ListSink(), hooks=BigOrders()
    )
    model.answers.extend([calls_lookup(), answers("Done.")])
    await sequencer.on_request(request("t1"))

    [delay] = await sequencer.on_step(work("t1", 0))
    assert isinstance(delay, Delay) and tools.calls == []
    assert await sequencer.on_decision(decide("call_1")) == [kick("t1")]
    assert await sequencer.on_step(work("t1", 0)) == [kick("t1", 1)]

    assert [c.arguments for c in tools.calls] == [{"q": "42"}]
