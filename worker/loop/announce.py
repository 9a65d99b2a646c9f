"""What the loop announces: a lifecycle event about a turn, built from the state it is in.

Events only observe: a publish that fails is logged and the turn goes on. The events of a step
(``step_events``) are built from its saved records alone, so the worker that ends a turn and one
that announces its end again (``worker.sequencing.sequencer``) publish the same events, byte for byte.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from contracts.events import (
    EVENT_TYPES,
    Event,
    EventData,
    EventType,
    MessageDelta,
    StateUpdated,
    StepCompleted,
    ToolInvoked,
    TurnFinished,
    make_event,
)
from contracts.messages import ChatMessage, Usage
from contracts.state import AgentState, EndedStep, StepExecution, ToolExecution
from contracts.turns import TurnParent, TurnResult
from worker.loop.ports import EventSink
from worker.loop.streaming import Publish

log = logging.getLogger("loopwire.loop")


@dataclass(frozen=True, slots=True)
class Subject:
    """The turn an event is about, as the event names it."""

    agent: str
    turn_id: str | None
    session_id: str
    parent: TurnParent | None

    @classmethod
    def of_state(cls, state: AgentState, data: EventData | None = None) -> Subject:
        ex = state.execution
        if ex is not None:
            return cls(ex.request.agent, ex.turn_id, state.session_id, ex.request.parent)
        turn_id = data.result.turn_id if isinstance(data, TurnFinished) else None
        return cls(state.agent, turn_id, state.session_id, None)

    @classmethod
    def of_result(cls, result: TurnResult) -> Subject:
        return cls(result.agent, result.turn_id, result.session_id, result.parent)

    def event(
        self,
        event_type: EventType,
        data: EventData,
        now: float,
        *,
        step: int | None = None,
        call_id: str = "",
        id_suffix: str = "",
    ) -> Event:
        return make_event(
            event_type,
            data,
            agent=self.agent,
            time=now,
            turn_id=self.turn_id,
            session_id=self.session_id,
            step=step,
            call_id=call_id,
            id_suffix=id_suffix,
            parent=self.parent,
        )


async def publish(events: EventSink, event: Event) -> None:
    try:
        await events.emit(event)
    except Exception:
        log.exception("could not publish %s for turn %s", event.type, event.turn_id)


async def announce(
    events: EventSink,
    now: float,
    event_type: EventType,
    data: EventData,
    state: AgentState,
    *,
    step: int | None = None,
    call_id: str = "",
    id_suffix: str = "",
) -> None:
    subject = Subject.of_state(state, data)
    event = subject.event(event_type, data, now, step=step, call_id=call_id, id_suffix=id_suffix)
    await publish(events, event)


def delta_publisher(
    events: EventSink, state: AgentState, step: int, clock: Callable[[], float]
) -> Publish:
    """Publishes a step's ``message.delta`` events; it keeps the few fields of the state an
    event names, not the state (held while the model writes)."""
    assert state.execution is not None
    subject = Subject.of_state(state)

    async def send(delta: MessageDelta, id_suffix: str) -> None:
        event = subject.event("message.delta", delta, clock(), step=step, id_suffix=id_suffix)
        await publish(events, event)

    return send


def result_events(execution: ToolExecution) -> list[tuple[EventType, EventData]]:
    """What a saved result announces: ``tool.invoked``, and ``state.updated`` when it set
    state (at the saved record's time: an event published again is the same)."""
    found: list[tuple[EventType, EventData]] = [
        (
            "tool.invoked",
            ToolInvoked(
                tool=execution.name,
                call_id=execution.call_id,
                outcome=execution.outcome,
                duration_s=execution.duration_s,
                truncated=execution.truncated,
                error=execution.error[:500] if execution.error else None,
                unresolved_placeholders=execution.unresolved_placeholders,
            ),
        )
    ]
    if execution.state_keys:
        updated = StateUpdated(
            call_id=execution.call_id, tool=execution.name, keys=execution.state_keys
        )
        found.append(("state.updated", updated))
    return found


def step_completed(record: StepExecution) -> StepCompleted:
    """``step.completed``'s data for a step the state records."""
    step = record.step
    response = step.response
    return StepCompleted(
        step_type=step.type,
        finish_reason=response.finish_reason if response else "error",
        tool_calls=len(step.tool_executions),
        usage=response.usage if response else Usage(),
        duration_s=record.duration_s,
        model_duration_s=response.duration_s if response else 0.0,
        model=response.model or None if response else None,
        provider=response.provider if response else None,
        cost_usd=response.cost_usd if response else 0.0,
        input_messages=step.input_count if step.sent_tokens is not None else None,
        input_tokens_estimate=step.sent_tokens,
        summarized=step.summarized,
    )


def step_events(
    subject: Subject,
    record: StepExecution,
    invoked: Sequence[ToolExecution],
    announced: Collection[str],
) -> list[Event]:
    """The events of a completed step, of the types announced: ``tool.invoked`` (and
    ``state.updated``) for the results its save stored, then ``step.completed``."""
    index = record.step.index
    found = [
        subject.event(kind, data, execution.completed_at, step=index, call_id=execution.call_id)
        for execution in invoked
        for kind, data in result_events(execution)
        if kind in announced
    ]
    if "step.completed" in announced:
        found.append(
            subject.event("step.completed", step_completed(record), record.completed_at, step=index)
        )
    return found


def ended_step(turn_id: str, record: StepExecution, invoked: Sequence[ToolExecution]) -> EndedStep:
    """What ``step_events`` needs of a turn's last step, without the text it carries (the
    answer, the arguments, the results: the history and the result hold them already)."""

    def bare(execution: ToolExecution) -> ToolExecution:
        return execution.model_copy(update={"arguments": None, "value": None, "content": ""})

    step = record.step
    response = step.response
    if response is not None:
        response = response.model_copy(update={"message": ChatMessage(role="assistant")})
    bare_step = step.model_copy(
        update={
            "output_messages": (),
            "response": response,
            "tool_executions": tuple(bare(e) for e in step.tool_executions),
        }
    )
    return EndedStep(
        turn_id=turn_id,
        record=record.model_copy(update={"step": bare_step}),
        invoked=tuple(bare(e) for e in invoked),
    )


async def announce_ended_step(
    events: EventSink, result: TurnResult, state: AgentState | None
) -> None:
    """The events of a finished turn's last step once more (``state``: the session after it),
    before its end is announced again: the worker that ended the turn may still be publishing
    them, and no subscriber may see a step after its turn's end. They are the same events, so
    a subscriber drops the copy it sees second; the sink publishes only the types announced."""
    ended = state.ended_step if state is not None else None
    if ended is None or ended.turn_id != result.turn_id:
        return
    subject = Subject.of_result(result)
    for event in step_events(subject, ended.record, ended.invoked, EVENT_TYPES):
        await publish(events, event)
