"""What the loop announces: a lifecycle event about a turn, built from the state it is in.

Events only observe: a publish that fails is logged and the turn goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from contracts.events import (
    EventData,
    EventType,
    MessageDelta,
    StepCompleted,
    TurnFinished,
    make_event,
)
from contracts.messages import Usage
from contracts.state import AgentState, StepExecution
from worker.loop.ports import EventSink
from worker.loop.streaming import Publish

log = logging.getLogger("loopwire.loop")


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
    ex = state.execution
    turn_id = (
        ex.turn_id if ex else (data.result.turn_id if isinstance(data, TurnFinished) else None)
    )
    event = make_event(
        event_type,
        data,
        agent=ex.request.agent if ex else state.agent,
        time=now,
        turn_id=turn_id,
        session_id=state.session_id,
        step=step,
        call_id=call_id,
        id_suffix=id_suffix,
        parent=ex.request.parent if ex else None,
    )
    try:
        await events.emit(event)
    except Exception:
        log.exception("could not publish %s for turn %s", event_type, turn_id)


def delta_publisher(
    events: EventSink, state: AgentState, step: int, clock: Callable[[], float]
) -> Publish:
    """Publishes a step's ``message.delta`` events; it keeps the few fields of the state an
    event names, not the state (held while the model writes)."""
    ex = state.execution
    assert ex is not None
    agent, turn_id, session_id, parent = (
        ex.request.agent,
        ex.turn_id,
        state.session_id,
        ex.request.parent,
    )

    async def publish(delta: MessageDelta, id_suffix: str) -> None:
        event = make_event(
            "message.delta",
            delta,
            agent=agent,
            time=clock(),
            turn_id=turn_id,
            session_id=session_id,
            step=step,
            id_suffix=id_suffix,
            parent=parent,
        )
        try:
            await events.emit(event)
        except Exception:
            log.exception("could not publish message.delta for turn %s", turn_id)

    return publish


async def announce_step(
    events: EventSink, now: float, state: AgentState, record: StepExecution
) -> None:
    """``step.completed`` for a step the state records."""
    step = record.step
    response = step.response
    await announce(
        events,
        now,
        "step.completed",
        StepCompleted(
            step_type=step.type,
            finish_reason=response.finish_reason if response else "error",
            tool_calls=len(step.tool_executions),
            usage=response.usage if response else Usage(),
            duration_s=record.duration_s,
            model_duration_s=response.duration_s if response else 0.0,
            model=response.model or None if response else None,
            provider=response.provider if response else None,
            input_messages=step.input_count if step.sent_tokens is not None else None,
            input_tokens_estimate=step.sent_tokens,
            summarized=step.summarized,
        ),
        state,
        step=step.index,
    )
