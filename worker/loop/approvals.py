"""Human approval of tool calls: which calls of a step wait for a decision, and the step's
state when it parks or goes on.

An agent lists tools under ``approval`` (or ``"*"``), and a hook's ``needs_approval`` may ask
for a call too (a call a hook asked for waits while its turn is parked: the hook is asked
once, when the step first reaches its tools, and its answer is kept in the wait). When the
model calls one, the step saves
the model's answer as usual, then parks the turn (``status: waiting`` with an ``approval``
wait naming the undecided calls) instead of running its tools: no worker holds it while a
human decides. Decisions (``turn.decision``) are recorded beside the turn; once every waiting
call is decided, or the wait times out (an undecided call is then rejected by ``timeout``), a
worker runs the step's tool phase: approved calls run, edited ones with the new arguments,
rejected ones answer the model ``{"error": "rejected by <who>: <message>"}``. Calls of the
step that need no approval wait with the others, so the step's results stay in call order.
"""

from __future__ import annotations

from collections.abc import Mapping

from contracts.control import ApprovalRequest, TurnDecision
from contracts.state import AgentState, PendingStep, Wait
from worker.loop.spec import AgentSpec
from worker.loop.turn import turn_of, with_execution


def undecided(
    pending: PendingStep, agent: AgentSpec, asked: frozenset[str] = frozenset()
) -> tuple[str, ...]:
    """Ids of the step's calls that need approval (their tool is listed, or a hook asked for
    it: ``asked``) and have neither a decision nor a result."""
    if pending.response is None or not (agent.approval or asked):
        return ()
    return tuple(
        call.id
        for call in pending.response.message.tool_calls
        if (agent.needs_approval(call.name) or call.id in asked)
        and call.id not in pending.decisions
        and pending.result_for(call.id) is None
    )


def parked(
    state: AgentState, call_ids: tuple[str, ...], now: float, timeout_s: float
) -> AgentState:
    """The turn waiting for decisions on ``call_ids``, until ``now + timeout_s`` or the turn's
    deadline, whichever comes first (at the deadline the turn ends as at any deadline)."""
    until = now + timeout_s
    deadline = turn_of(state).request.deadline
    if deadline is not None:
        until = min(until, deadline)
    wait = Wait(kind="approval", call_ids=call_ids, since=now, until=until)
    return with_execution(state, status="waiting", wait=wait)


def with_decisions(state: AgentState, decisions: Mapping[str, TurnDecision]) -> AgentState:
    """The state with the decisions recorded for its waiting calls (others are ignored: a
    decision for a call the step does not wait on, or a second one, changes nothing)."""
    ex = turn_of(state)
    pending, wait = ex.pending, ex.wait
    if pending is None or wait is None or wait.kind != "approval":
        return state
    new = {
        call_id: decision
        for call_id, decision in decisions.items()
        if call_id in wait.call_ids and call_id not in pending.decisions
    }
    if not new:
        return state
    merged = pending.model_copy(update={"decisions": {**pending.decisions, **new}})
    return with_execution(state, pending=merged)


def timed_out(state: AgentState, now: float) -> AgentState:
    """The waiting calls still undecided rejected by ``timeout``."""
    ex = turn_of(state)
    wait = ex.wait
    assert wait is not None and ex.pending is not None
    waited = f"no decision within {round(now - wait.since)}s"
    rejections = {
        call_id: TurnDecision(
            turn_id=ex.turn_id, call_id=call_id, decision="reject", message=waited, by="timeout"
        )
        for call_id in wait.call_ids
        if call_id not in ex.pending.decisions
    }
    return with_decisions(state, rejections)


def waiting_list(state: AgentState) -> tuple[list[ApprovalRequest], list[str]]:
    """A turn parked for approval as the fleet-wide list of waiting calls holds it
    (``loopwire approvals``): its calls still waiting for a decision, and the ids of the calls
    decided already (off the list)."""
    ex = turn_of(state)
    wait, pending = ex.wait, ex.pending
    assert wait is not None and pending is not None and pending.response is not None
    calls = {c.id: c for c in pending.response.message.tool_calls}
    open_ = [
        ApprovalRequest(
            turn_id=ex.turn_id,
            session_id=state.session_id,
            agent=ex.request.agent,
            call_id=call_id,
            tool=calls[call_id].name,
            arguments=calls[call_id].arguments,
            since=wait.since,
            until=wait.until,
        )
        for call_id in wait.call_ids
        if call_id not in pending.decisions
    ]
    return open_, list(pending.decisions)
