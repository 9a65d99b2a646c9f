"""A turn's records as pure functions of the state: a new turn attached to its session, the
result of a finished one, and the session once it is over."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from contracts.messages import ChatMessage
from contracts.state import (
    AgentState,
    AgentStep,
    ExecutionState,
    ModelResponse,
    PendingStep,
    StepExecution,
    StopSignal,
    ToolExecution,
    counted_model,
)
from contracts.turns import FinishReason, TurnError, TurnRequest, TurnResult
from worker.loop.budgets import turn_spend
from worker.loop.spec import AgentSpec


def new_execution(
    state: AgentState | None, request: TurnRequest, agent: AgentSpec, now: float
) -> AgentState:
    """The session with a fresh turn attached (creating the session when it is new)."""
    if state is None:
        state = AgentState(
            session_id=request.session_id,
            parent_session_id=request.parent_session_id,
            agent=request.agent,
            created_at=now,
            updated_at=now,
        )
    execution = ExecutionState(
        turn_id=request.turn_id,
        request=request,
        limits=request.limits.apply(agent.limits),
        prompt_version=agent.prompt_version,
        history_start=state.history_len,
        started_at=now,
        updated_at=now,
    )
    return state.model_copy(update={"execution": execution, "ended_step": None, "updated_at": now})


def turn_result(
    state: AgentState,
    reason: FinishReason,
    content: str | None,
    error: TurnError | None,
    now: float,
    output: Any = None,
) -> TurnResult:
    """The result of the turn attached to ``state``, finishing now for ``reason``."""
    ex = turn_of(state)
    stop: StopSignal | None = ex.stop_signal if reason in ("stop", "cancelled", "budget") else None
    return TurnResult(
        turn_id=ex.turn_id,
        session_id=state.session_id,
        agent=ex.request.agent,
        content=content,
        finish_reason=reason,
        error=error,
        stopped_by=stop.source if stop else None,
        usage=ex.usage,
        cost_usd=ex.cost_usd,
        steps=ex.step_count,
        duration_s=max(0.0, now - ex.started_at),
        completed_at=now,
        output=output,
        parent=ex.request.parent,
        prompt_version=ex.prompt_version,
        models=tuple(run.model for run in ex.models for _ in range(run.steps)),
    )


def closed(state: AgentState, *, appended: int, now: float) -> AgentState:
    """The session once its turn is over: no turn attached, ``appended`` more history. A
    ``persist: false`` turn leaves the session as it found it: its count of turns too."""
    ex = state.execution
    counted = 0 if ex is not None and not ex.request.persist else 1
    spent = state.spent
    if ex is not None and ex.request.persist:
        # a persist: false turn leaves the session as it was; it counts only in the turn's
        # own budget and the agent's day
        spent = spent + turn_spend(ex, now)
    return state.model_copy(
        update={
            "execution": None,
            "execution_count": state.execution_count + counted,
            "spent": spent,
            "history_len": state.history_len + appended,
            "updated_at": now,
        }
    )


def turn_of(state: AgentState) -> ExecutionState:
    if state.execution is None:
        raise ValueError(f"session {state.session_id} has no turn in progress")
    return state.execution


def with_execution(state: AgentState, **changes: Any) -> AgentState:
    ex = turn_of(state).model_copy(update=changes)
    return state.model_copy(update={"execution": ex})


def with_step(state: AgentState, record: StepExecution, **changes: Any) -> AgentState:
    """The state with ``record``'s step completed (counted: the record itself goes to the
    turn's step list with the save that passes it as ``step``), and ``changes``."""
    ex = turn_of(state)
    source = record.step.continued_by
    if source is not None and source not in ex.continued_by:
        changes["continued_by"] = (*ex.continued_by, source)
    return with_execution(
        state,
        step_count=ex.step_count + 1,
        tool_calls=ex.tool_calls + len(record.step.tool_executions),
        models=tuple(counted_model(ex.models, record)),
        **changes,
    )


def with_appended(state: AgentState, appended: int, now: float) -> AgentState:
    """The state with ``appended`` more messages counted into its turn and, when the turn is
    persisted, into the session's history."""
    ex = turn_of(state)
    changes: dict[str, object] = {"updated_at": now}
    update: dict[str, object] = {}
    if appended:
        changes["message_count"] = ex.message_count + appended
        if ex.request.persist:
            update["history_len"] = state.history_len + appended
    update["execution"] = ex.model_copy(update=changes)
    return state.model_copy(update=update)


def unanswered(pending: PendingStep, reason: str) -> list[ChatMessage]:
    """The tool messages of a step ended before it recorded its tool results: each call's saved
    result, or an error for one that got none."""
    response = pending.response
    if response is None:
        return []
    messages = []
    for call in response.message.tool_calls:
        saved = pending.result_for(call.id)
        content = (
            saved.content
            if saved is not None
            else json.dumps({"error": f"not run: the turn ended ({reason})"})
        )
        messages.append(ChatMessage.tool(call.id, content))
    return messages


def recorded_step(
    pending: PendingStep, executions: Sequence[ToolExecution]
) -> tuple[AgentStep, list[ChatMessage]]:
    """The record of a completed step from its pending state and its judged tool results, and
    the tool messages that go to the history. Once judged, a value too large for the model is
    not kept: the truncated content is what the model saw; the full value would only grow every
    later save."""
    response = pending.response
    assert response is not None
    tool_messages = [ChatMessage.tool(e.call_id, e.content) for e in executions]
    kept = tuple(e.model_copy(update={"value": None}) if e.truncated else e for e in executions)
    step = AgentStep(
        index=pending.index,
        input_count=pending.input_count,
        sent_tokens=pending.sent_tokens,
        summarized=pending.summarized,
        output_messages=(response.message, *tool_messages),
        response=response,
        tool_executions=kept,
        errors=tuple(f"{e.name}: {e.error}" for e in kept if e.outcome in ("error", "unknown")),
    )
    return step, tool_messages


def unique_call_ids(response: ModelResponse, taken: Iterable[str], step: int) -> ModelResponse:
    """Tool call ids unique within the turn. The id is part of the call's idempotency key, so a
    server that reuses ids (``call_0`` in every step) would otherwise get an earlier call's
    stored reply; a reused or repeated id (``taken``: the ids of the turn's earlier calls) is
    suffixed with the step and position."""
    calls = response.message.tool_calls
    if not calls:
        return response
    seen = set(taken)
    fixed = []
    for position, call in enumerate(calls):
        call_id = call.id
        if call_id in seen:
            call_id = f"{call.id[:200]}-{step}-{position}"
        seen.add(call_id)
        fixed.append(call if call_id == call.id else call.model_copy(update={"id": call_id}))
    if fixed == list(calls):
        return response
    message = response.message.model_copy(update={"tool_calls": tuple(fixed)})
    return response.model_copy(update={"message": message})
