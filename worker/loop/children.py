"""Child turns: a sub-agent call and a workflow node, as pure functions of the parent's state.

A child is a ``TurnRequest`` like any other, run by any worker, with ``parent`` = (session,
turn, call id, root turn, depth). Its turn id derives from the parent's turn id and the call
id, so a step redone after a crash starts no second child: the request is a duplicate of the
first. Its session derives from the parent's session, turn and call id (a conversation of its
own for each call), unless the caller's profile names one for that agent. It inherits the
parent's metadata, and as budget what is left of the parent's per-turn budget (tokens, cost,
wall time); its deadline is when the parent stops waiting for it (the parent's deadline, or
the caller's ``children_timeout_s`` on), so a child that comes too late runs nothing.

The parent parks with a ``children`` wait; each child's ``TurnResult`` comes back as a
``turn.child_result`` control message and is recorded like a tool result of its call
(``with_child_results``): the answer, or its structured output, for a child that answered;
``{"error": ...}`` for one that failed, was cancelled or stopped at its iteration cap. Its
usage and cost are added to the parent's, so the parent's budgets and result count them (but
not the parent agent's day: the child's own agent's day counts them, once).
A call deeper than the caller's ``max_depth`` is answered with an error and starts nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from contracts.control import TurnChildResult
from contracts.messages import ToolCall
from contracts.state import AgentState, ChildTurn, ToolExecution
from contracts.tools import ToolDefinition
from contracts.turns import (
    Budget,
    InputMessage,
    TurnError,
    TurnParent,
    TurnRequest,
    TurnResult,
)
from worker.loop.budgets import turn_spend
from worker.loop.spec import AgentSpec
from worker.loop.turn import turn_of, with_execution

INPUT_SCHEMA = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "What to ask the agent."}},
    "required": ["input"],
    "additionalProperties": False,
}


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def child_turn_id(parent_turn_id: str, call_id: str) -> str:
    """The child turn of a call: the same for every step that makes the call again."""
    return f"{parent_turn_id[:100]}-{_digest(parent_turn_id, call_id)}"


def misdirected(message: TurnChildResult) -> str | None:
    """Why ``message`` is not the result of the child its parent's call started (``None``: it
    is): the result names another parent, or a turn other than the one that call derived."""
    parent, result = message.parent, message.result
    if result.parent != parent:
        return "the result names another parent than the message"
    if result.turn_id != child_turn_id(parent.turn_id, parent.call_id):
        return f"turn {result.turn_id} is not the child call {parent.call_id} started"
    return None


def child_session_id(parent_session_id: str, parent_turn_id: str, call_id: str) -> str:
    return f"{parent_session_id[:100]}-{_digest(parent_session_id, parent_turn_id, call_id)}"


def agent_tools(agent: AgentSpec) -> list[ToolDefinition]:
    """The agents ``agent`` may call, as the model sees them (their descriptions are filled in
    from their profiles when the agents file loads)."""
    return [
        ToolDefinition(
            name=sub.agent,
            description=sub.description or f"The {sub.agent} agent.",
            parameters=INPUT_SCHEMA,
        )
        for sub in agent.agents
    ]


def is_child_call(agent: AgentSpec, name: str) -> bool:
    return agent.workflow is not None or agent.sub_agent(name) is not None


@dataclass(frozen=True, slots=True)
class Planned:
    """The children a step starts, and the calls refused (their error results)."""

    children: tuple[ChildTurn, ...]
    requests: tuple[TurnRequest, ...]
    refused: tuple[ToolExecution, ...]


def plan_children(
    state: AgentState, agent: AgentSpec, calls: Sequence[ToolCall], now: float, until: float
) -> Planned:
    """The child turn of each call, or the error that answers it instead: arguments without an
    ``input`` text, the depth limit, a spent budget, a stopped turn. ``until``: when the parent
    stops waiting for them, each child's deadline."""
    ex = turn_of(state)
    budget = _left(state, agent, now)
    children, requests, refused = [], [], []
    for call in calls:
        error = None
        text = _input(call.arguments)
        if ex.stop_signal is not None:
            error = f"not run: the turn was stopped by {ex.stop_signal.source}"
        elif text is None:
            error = "arguments must be a JSON object with an 'input' string"
        elif _depth(state) > agent.max_depth:
            error = f"not run: sub-agents may nest {agent.max_depth} deep (max_depth)"
        elif budget is None:
            error = "not run: the turn's budget is spent"
        if error is not None or text is None:
            refused.append(_refused(call, error or "", now))
            continue
        sub = agent.sub_agent(call.name)
        session = sub.session if sub is not None and sub.session else None
        child = ChildTurn(
            call_id=call.id,
            turn_id=child_turn_id(ex.turn_id, call.id),
            session_id=session or child_session_id(state.session_id, ex.turn_id, call.id),
            agent=call.name,
        )
        children.append(child)
        requests.append(
            TurnRequest(
                turn_id=child.turn_id,
                session_id=child.session_id,
                agent=child.agent,
                input=(InputMessage(content=text),),
                parent_session_id=state.session_id,
                parent=_parent(state, call.id),
                metadata=ex.request.metadata,
                deadline=until,
                budget=budget,
            )
        )
    return Planned(tuple(children), tuple(requests), tuple(refused))


def _depth(state: AgentState) -> int:
    """The depth of the state's turn's children in their tree."""
    parent = turn_of(state).request.parent
    return (parent.depth if parent is not None else 0) + 1


def _parent(state: AgentState, call_id: str) -> TurnParent:
    """The parent of the child turn of a call of the state's turn."""
    ex = turn_of(state)
    parent = ex.request.parent
    return TurnParent(
        session_id=state.session_id,
        turn_id=ex.turn_id,
        call_id=call_id,
        root_turn_id=parent.root_turn_id if parent is not None else ex.turn_id,
        depth=_depth(state),
    )


def child_failed(
    parent: TurnParent, child: ChildTurn, code: str, message: str, now: float
) -> TurnChildResult:
    """The result of a child turn that could not run or answer, for its parent: an error."""
    result = TurnResult(
        turn_id=child.turn_id,
        session_id=child.session_id,
        agent=child.agent,
        content=None,
        finish_reason="error",
        error=TurnError(code=code, message=message[:4000]),
        steps=0,
        duration_s=0.0,
        completed_at=now,
        parent=parent,
    )
    return TurnChildResult(parent=parent, result=result)


def late_children(
    state: AgentState, recorded: Mapping[str, TurnChildResult], now: float
) -> list[tuple[ChildTurn, TurnChildResult]]:
    """The children a turn still waits on at the end of its wait (none of their results is
    recorded), each with its error result: no answer in time."""
    wait = turn_of(state).wait
    assert wait is not None
    waited = f"no answer within {round(now - wait.since)}s"
    return [
        (child, child_failed(_parent(state, child.call_id), child, "child_timeout", waited, now))
        for child in unanswered_children(state)
        if child.call_id not in recorded
    ]


def given_up(state: AgentState, recorded: Mapping[str, TurnChildResult]) -> list[ChildTurn]:
    """The children a turn stopped waiting for (their ``child_timeout`` errors recorded) that
    it has not taken into its state yet: the delivery that gave up on them may have died before
    it could cancel them and wake the turn."""
    return [
        child
        for child in unanswered_children(state)
        if (r := recorded.get(child.call_id)) is not None
        and r.result.error is not None
        and r.result.error.code == "child_timeout"
    ]


def with_child_results(
    state: AgentState, results: Mapping[str, TurnChildResult]
) -> tuple[AgentState, list[tuple[ChildTurn, TurnResult]]]:
    """The parked turn with the results recorded for the children it waits on that it has not
    recorded yet (each a tool result of its call, appended in that order; usage and cost
    added), and those children with their results."""
    ex = turn_of(state)
    wait, pending = ex.wait, ex.pending
    if wait is None or wait.kind != "children" or pending is None or not results:
        return state, []
    fresh = [
        (child, results[child.call_id].result)
        for child in wait.children
        if child.call_id in results and pending.result_for(child.call_id) is None
    ]
    if not fresh:
        return state, []
    executions = tuple(child_execution(child, result, wait.since) for child, result in fresh)
    usage, cost = ex.usage, ex.cost_usd
    tokens, children_cost = ex.children_tokens, ex.children_cost_usd
    for _, result in fresh:
        usage, cost = usage + result.usage, cost + result.cost_usd
        tokens += result.usage.total_tokens
        children_cost += result.cost_usd
    merged = pending.model_copy(update={"results": (*pending.results, *executions)})
    return with_execution(
        state,
        pending=merged,
        usage=usage,
        cost_usd=cost,
        children_tokens=tokens,
        children_cost_usd=children_cost,
    ), fresh


def child_execution(child: ChildTurn, result: TurnResult, started: float) -> ToolExecution:
    """A child's result as the tool result of its call."""
    error = _failure(child.agent, result)
    if error is None:
        value = result.output if result.output is not None else (result.content or "")
        content = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    else:
        value, content = None, json.dumps({"error": error}, ensure_ascii=False)
    return ToolExecution(
        call_id=child.call_id,
        name=child.agent,
        outcome="ok" if error is None else "error",
        value=value,
        error=error,
        content=content,
        started_at=started,
        completed_at=max(started, result.completed_at),
    )


def unanswered_children(state: AgentState) -> tuple[ChildTurn, ...]:
    """The children a turn still waits on (cancelled when it ends)."""
    ex = state.execution
    if ex is None or ex.wait is None or ex.wait.kind != "children" or ex.pending is None:
        return ()
    pending = ex.pending
    return tuple(c for c in ex.wait.children if pending.result_for(c.call_id) is None)


def _failure(agent: str, result: TurnResult) -> str | None:
    if result.finish_reason in ("stop", "length", "budget"):
        return None
    if result.finish_reason == "error":
        assert result.error is not None
        return f"sub-agent {agent} failed: {result.error.code}: {result.error.message}"
    if result.finish_reason == "cancelled":
        return f"sub-agent {agent} was cancelled ({result.stopped_by or 'cancelled'})"
    last = (result.content or "")[:2000]
    return f"sub-agent {agent} stopped at its iteration cap without an answer; it last said: {last}"


def _input(arguments: str) -> str | None:
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return None
    text = parsed.get("input") if isinstance(parsed, dict) else None
    return text if isinstance(text, str) and text.strip() else None


def _refused(call: ToolCall, error: str, now: float) -> ToolExecution:
    return ToolExecution(
        call_id=call.id,
        name=call.name,
        outcome="error",
        error=error,
        content=json.dumps({"error": error}, ensure_ascii=False),
        started_at=now,
        completed_at=now,
    )


def _left(state: AgentState, agent: AgentSpec, now: float) -> Budget | None:
    """What is left of the turn's own budget for a child (tokens, cost, wall time); ``None``
    when some of it is spent."""
    ex = turn_of(state)
    budget = agent.budget.lowered(ex.request.budget)
    if budget.empty:
        return budget
    spent = turn_spend(ex, now)
    left: dict[str, float | int | None] = {
        "max_total_tokens": None
        if budget.max_total_tokens is None
        else budget.max_total_tokens - spent.total_tokens,
        "max_cost_usd": None
        if budget.max_cost_usd is None
        else budget.max_cost_usd - spent.cost_usd,
        "max_wall_s": None if budget.max_wall_s is None else budget.max_wall_s - spent.wall_s,
    }
    if any(v is not None and v <= 0 for v in left.values()):
        return None
    return Budget.model_validate(left)
