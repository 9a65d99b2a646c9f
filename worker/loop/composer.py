"""Composition in the loop: the children gate of a step (its calls to sub-agents start child
turns and park it) and the step of a workflow turn, which runs no model (its rounds are
planned by ``worker.loop.workflow`` and each runs as child turns through the same gate).
``Loop`` (``worker.loop.engine``) mixes it in; the child turns themselves are pure functions
of the state (``worker.loop.children``).

The gate, for the calls of a step that name a sub-agent (a workflow's every call):

1. first time: each call gets its child turn, with a reviewer's edited arguments if any (or
   an error result: a reviewer's rejection, a blocking hook, bad arguments, the depth limit,
   a spent budget); the turn is saved parked (``children`` wait, until its deadline or
   ``children_timeout_s`` on, whichever is first), ``child.started`` is announced for each,
   and the step asks for the requests to be published (``Waiting.start``);
2. parked: the results recorded so far are merged in by the worker that woke it
   (``with_child_results``); once every child answered the step goes on (its tool phase finds
   them recorded), else the new results are saved and it parks again. A wake that brought
   nothing new publishes the requests of the children still out again (the worker that parked
   it may have died before it could; a copy is a duplicate and runs nothing). When the wait
   ends, each child still out is answered with an error and cancelled (``worker.sequencing.controls``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from contracts.events import ChildStarted
from contracts.messages import ChatMessage, ToolCall
from contracts.state import (
    AgentState,
    AgentStep,
    ChildTurn,
    ModelResponse,
    PendingStep,
    StepExecution,
    StopSignal,
    ToolExecution,
    Wait,
)
from contracts.turns import TurnError
from worker.loop.budgets import configured, first_spent
from worker.loop.children import is_child_call, plan_children
from worker.loop.fitting import Fitting
from worker.loop.hooks import Blocked, HookContext, ToolInvocation
from worker.loop.outcomes import Finished, RunAgain, StepOutcome, Waiting
from worker.loop.ports import observe
from worker.loop.spec import AgentSpec
from worker.loop.tool_calls import Refused, call_arguments, error_content
from worker.loop.turn import turn_of, with_execution, with_step
from worker.loop.workflow import Done, NodeFailed, input_text, plan, rounds_of

Gated = tuple[AgentState, tuple[ToolExecution, ...]] | Waiting
"""After the gate: the step goes on (with the results its save is to store and announce), or
it is parked."""


class Composer(Fitting):
    """Mixed into ``Loop``: the children gate and the workflow step."""

    __slots__ = ()

    async def _children(
        self, state: AgentState, agent: AgentSpec, unsaved: Sequence[ToolExecution]
    ) -> Gated:
        ex = turn_of(state)
        pending = ex.pending
        assert pending is not None and pending.response is not None
        calls = pending.response.message.tool_calls
        wait = ex.wait
        if wait is not None and wait.kind == "children":
            return await self._children_answered(state, agent, wait, calls)
        todo = [
            c for c in calls if is_child_call(agent, c.name) and pending.result_for(c.id) is None
        ]
        if not todo:
            return state, tuple(unsaved)
        now = self.clock()
        todo, blocked = await self._passed(state, agent, todo, now)
        until = _children_until(agent, ex.request.deadline, now)
        planned = plan_children(state, agent, todo, now, until)
        planned = replace(planned, refused=(*blocked, *planned.refused))
        if planned.refused:
            merged = pending.model_copy(update={"results": (*pending.results, *planned.refused)})
            state = with_execution(state, pending=merged)
        if not planned.children:
            return state, (*unsaved, *planned.refused)
        waiting = Wait(
            kind="children",
            call_ids=tuple(c.call_id for c in planned.children),
            children=planned.children,
            since=now,
            until=until,
        )
        state = await self._save(
            with_execution(state, status="waiting", wait=waiting), release=True
        )
        for execution in (*unsaved, *planned.refused):
            await self.tools.emit_invoked(state, pending.index, execution)
        await self._announce_started(state, pending.index, planned.children, now)
        observe(self.observer.children_started, ex.request.agent, len(planned.children))
        return Waiting(state, waiting.until, start=planned.requests)

    async def _children_answered(
        self, state: AgentState, agent: AgentSpec, wait: Wait, calls: Sequence[ToolCall]
    ) -> Gated:
        ex = turn_of(state)
        pending = ex.pending
        assert pending is not None
        answered = sum(1 for c in wait.children if pending.result_for(c.call_id) is not None)
        if answered > wait.answered and agent.workflow is None:
            state = await self._judged(state, agent, answered - wait.answered)
        if answered == len(wait.children):
            return with_execution(state, status="in_progress", wait=None), ()
        if answered > wait.answered:
            more = wait.model_copy(update={"answered": answered})
            state = await self._save(with_execution(state, wait=more), release=True)
            return Waiting(state, wait.until)
        out = {c.call_id for c in wait.children if pending.result_for(c.call_id) is None}
        now = self.clock()
        passed, _ = await self._passed(state, agent, [c for c in calls if c.id in out], now)
        # the same requests as at first (a wait saved without a bound gets one now)
        until = wait.until or _children_until(agent, ex.request.deadline, wait.since)
        again = plan_children(state, agent, passed, now, until)
        # and announced again, the same events: the worker that parked the turn may have died
        # before it announced them
        await self._announce_started(state, pending.index, again.children, wait.since)
        return Waiting(state, wait.until, start=again.requests)

    async def _announce_started(
        self, state: AgentState, index: int, children: Sequence[ChildTurn], at: float
    ) -> None:
        """``child.started`` for each child, as of ``at`` (when the step started them)."""
        for child in children:
            await self._emit(
                "child.started",
                ChildStarted(
                    call_id=child.call_id,
                    turn_id=child.turn_id,
                    session_id=child.session_id,
                    agent=child.agent,
                ),
                state,
                step=index,
                call_id=child.call_id,
                at=at,
            )

    async def _passed(
        self, state: AgentState, agent: AgentSpec, calls: Sequence[ToolCall], now: float
    ) -> tuple[list[ToolCall], list[ToolExecution]]:
        """The calls to sub-agents through a reviewer's decision and the ``before_tool`` hooks,
        like calls to tools: with the edited arguments, if any, as the hooks give them (the
        ``redact`` set leaves its placeholders in: a child gets them, never the values), or
        blocked (rejected, or by a hook). A workflow's calls are its own: they pass as they
        are."""
        if agent.workflow is not None or not calls:
            return list(calls), []
        ex = turn_of(state)
        assert ex.pending is not None
        ctx = HookContext(state=state, agent=agent, step=ex.pending.index)
        passed, blocked = [], []
        for call in calls:
            arguments = call_arguments(call, ex.pending)
            if isinstance(arguments, Refused):
                if arguments.outcome == "blocked":  # rejected by a reviewer
                    blocked.append(_blocked(call, arguments.given, arguments.error, now))
                else:
                    passed.append(call)  # refused by plan_children, with the reason
                continue
            decision = await self.hooks.before_tool(
                ctx, ToolInvocation(call.id, call.name, arguments)
            )
            if isinstance(decision, Blocked):
                blocked.append(_blocked(call, arguments, f"blocked: {decision.reason}", now))
            else:
                given = json.dumps(decision.arguments, ensure_ascii=False)
                passed.append(call if given == call.arguments else replace_args(call, given))
        return passed, blocked

    async def _judged(self, state: AgentState, agent: AgentSpec, fresh: int) -> AgentState:
        """The ``fresh`` child results merged last, through the ``after_tool`` hooks (redaction)
        and truncated, as a tool's result is before the model sees it."""
        ex = turn_of(state)
        pending = ex.pending
        assert pending is not None
        ctx = HookContext(state=state, agent=agent, step=pending.index)
        kept, new = pending.results[:-fresh], pending.results[-fresh:]
        judged = [await self.tools.after_tool(ctx, execution, ex) for execution in new]
        merged = pending.model_copy(update={"results": (*kept, *judged)})
        return with_execution(state, pending=merged)

    async def _flow_step(self, state: AgentState, agent: AgentSpec) -> StepOutcome:
        """One round of a workflow turn: plan it from the answers so far (or end the turn),
        start its nodes as child turns and park; once they answered, record the round."""
        flow = agent.workflow
        assert flow is not None
        opened = await self._opened(state, agent)
        if isinstance(opened, Finished):
            return opened
        state, ex = opened, turn_of(opened)
        if ex.pending is None:
            planned = plan(flow, input_text(ex), rounds_of(await self.store.load_steps(state)))
            if isinstance(planned, Done):
                answer = ChatMessage(role="assistant", content=planned.content)
                return await self.end(
                    state, agent, "stop", planned.content, append=[answer], output=planned.output
                )
            if isinstance(planned, NodeFailed):
                failed = TurnError(
                    code="node_failed", message=f"node {planned.node}: {planned.error}"[:4000]
                )
                return await self.end(state, agent, "error", ex.last_content, error=failed)
            if configured(agent, ex):
                spent = first_spent(state, agent, self.clock(), None)
                if spent is not None:
                    observe(self.observer.budget_exhausted, ex.request.agent, spent.name)
                    stopped = with_execution(state, stop_signal=StopSignal(source=spent.name))
                    return await self.end(stopped, agent, "budget", ex.last_content)
            now = self.clock()
            calls = tuple(
                ToolCall(id=c.call_id, name=c.run, arguments=json.dumps({"input": c.input}))
                for c in planned.calls
            )
            message = ChatMessage(role="assistant", tool_calls=calls)
            first = PendingStep(
                index=ex.step_count,
                started_at=now,
                response=ModelResponse(message=message, finish_reason="tool_calls"),
                dispatched_at=now,
            )
            state = with_execution(state, status="in_progress", pending=first)
        gated = await self._children(state, agent, ())
        if isinstance(gated, Waiting):
            return gated
        state = gated[0]
        ex = turn_of(state)
        pending = ex.pending
        assert pending is not None and pending.response is not None
        results = tuple(
            r
            for c in pending.response.message.tool_calls
            if (r := pending.result_for(c.id)) is not None
        )
        step = AgentStep(
            index=pending.index, input_count=0, response=pending.response, tool_executions=results
        )
        record = StepExecution(step=step, started_at=pending.started_at, completed_at=self.clock())
        last = results[-1].content if results else ex.last_content
        state = with_step(state, record, pending=None, last_content=last)
        state = await self._save(state, release=True, step=record)
        await self._emit_step(state, record)  # the nodes' answers: child.finished
        return RunAgain(state)


def _children_until(agent: AgentSpec, deadline: float | None, now: float) -> float:
    """When a wait for children ends: at the turn's deadline, or ``children_timeout_s`` on."""
    bound = now + agent.children_timeout_s
    return bound if deadline is None else min(deadline, bound)


def replace_args(call: ToolCall, arguments: str) -> ToolCall:
    return call.model_copy(update={"arguments": arguments})


def _blocked(
    call: ToolCall, arguments: dict[str, Any] | None, error: str, now: float
) -> ToolExecution:
    """A call to a sub-agent that starts no child: its error result for the model."""
    return ToolExecution(
        call_id=call.id,
        name=call.name,
        arguments=arguments,
        outcome="blocked",
        error=error,
        content=error_content(error),
        started_at=now,
        completed_at=now,
    )
