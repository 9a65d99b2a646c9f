"""The parts of a step that may stop or hold it before it runs its course (the turn's start and
its deadline, shared by agents and workflows; approvals; rate limits; budgets; the structured-
output judge), and the helpers
every phase saves and announces with: the approval gate (park, resume, a hook asking for an
approval), the rate-limit park, the budget check, the structured-output judge. ``Loop``
(``worker.loop.engine``) runs them; they live here to keep the engine to its phases.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from contracts import tenancy
from contracts.events import (
    ApprovalDecided,
    ApprovalRequested,
    BudgetExhausted,
    EventData,
    EventType,
    TurnStarted,
    TurnThrottled,
)
from contracts.messages import ChatMessage
from contracts.state import AgentState, StepExecution, StopSignal, ToolExecution, Wait
from contracts.tools import ToolDefinition
from contracts.turns import Budget, FinishReason, TurnError
from worker.loop.announce import Subject, announce, publish, step_events
from worker.loop.approvals import parked
from worker.loop.budgets import first_spent, tenant_ledger_name
from worker.loop.hooks import Hook, HookContext, ToolInvocation, asks_approval
from worker.loop.outcomes import Finished, RunAgain, StepOutcome, Waiting
from worker.loop.output import REPAIR_NOTE, parsed
from worker.loop.ports import (
    EventSink,
    LoopObserver,
    RateLimiter,
    RefundableLimiter,
    SpendLedger,
    StateStore,
    ToolCatalog,
    observe,
)
from worker.loop.spec import AgentSpec
from worker.loop.tools import ToolRunner
from worker.loop.turn import turn_of, with_appended, with_execution


class Gates:
    """Mixed into ``Loop``: what it has that these use."""

    __slots__ = ()

    announced: frozenset[str]
    clock: Callable[[], float]
    events: EventSink
    hooks: Hook
    ledger: SpendLedger | None
    limiter: RateLimiter | None
    tenant_budget: Callable[[str], Budget] | None
    tenant_limiter: Callable[[str], RefundableLimiter | None] | None

    def _tenant_budget(self) -> tuple[str, Budget] | None:
        """The current tenant and its daily budget, when it has one."""
        tenant = tenancy.current()
        if tenant is None or self.tenant_budget is None:
            return None
        budget = self.tenant_budget(tenant)
        return None if budget.empty else (tenant, budget)

    observer: LoopObserver
    store: StateStore
    tools: ToolRunner
    catalog: ToolCatalog

    async def end(
        self,
        state: AgentState,
        agent: AgentSpec,
        reason: FinishReason,
        content: str | None,
        *,
        error: TurnError | None = None,
        append: Sequence[ChatMessage] = (),
        step: StepExecution | None = None,
        invoked: Sequence[ToolExecution] = (),
        output: Any = None,
        rollback: bool = False,
    ) -> Finished:
        """The turn's one ending (``Loop.end``)."""
        raise NotImplementedError

    async def _opened(self, state: AgentState, agent: AgentSpec) -> AgentState | Finished:
        """The turn started (its first step: ``before_execution``, its input saved,
        ``turn.started``), or ended: a hook stopped it at its start, or its deadline passed
        (mid-step too: calls still out get a tool message saying they were not answered)."""
        ex = turn_of(state)
        if ex.status == "pending":
            state = await self._start(state, agent)
            ex = turn_of(state)
            if ex.stop_signal is not None:
                return await self.end(state, agent, "stop", ex.last_content)
        deadline = ex.request.deadline
        if deadline is not None and self.clock() >= deadline:
            late = with_execution(state, stop_signal=StopSignal(source="deadline"))
            return await self.end(late, agent, "cancelled", ex.last_content)
        return state

    async def _start(self, state: AgentState, agent: AgentSpec) -> AgentState:
        ex = turn_of(state)
        ctx = HookContext(state=state, agent=agent, step=0)
        await self.hooks.before_execution(ctx)
        inputs = [message.to_chat() for message in ex.request.input]
        now = self.clock()
        ex = ex.model_copy(
            update={"status": "in_progress", "stop_signal": ctx.stop_signal, "updated_at": now}
        )
        state = await self._save(state.model_copy(update={"execution": ex}), append=inputs)
        await self._emit(
            "turn.started",
            TurnStarted(
                history_len=ex.history_start,
                max_tool_iterations=ex.limits.max_tool_iterations,
                prompt_version=ex.prompt_version,
            ),
            state,
            at=ex.started_at,
        )
        observe(self.observer.turn_started, ex.request.agent)
        return state

    async def _hook_asks(self, state: AgentState, agent: AgentSpec) -> frozenset[str]:
        """The calls of the pending step a hook wants approved, or whose tool's definition asks
        for approval (``ToolDefinition.approval``, e.g. an MCP bridge's configuration). Once
        parked, the wait keeps them: neither is asked again."""
        ex = turn_of(state)
        if ex.wait is not None and ex.wait.kind == "approval":
            return frozenset(ex.wait.call_ids)
        if ex.pending is None or ex.pending.response is None:
            return frozenset()
        calls = ex.pending.response.message.tool_calls
        asked = {c.id for c in calls if _tool_asks_approval(self.catalog.last_known(c.name))}
        if not asks_approval(self.hooks):
            return frozenset(asked)
        ctx = HookContext(state=state, agent=agent, step=ex.pending.index)
        for call in calls:
            try:
                arguments = json.loads(call.arguments or "{}")
            except ValueError:
                continue  # refused in the tool phase
            if isinstance(arguments, dict) and await self.hooks.needs_approval(
                ctx, ToolInvocation(call.id, call.name, arguments)
            ):
                asked.add(call.id)
        return frozenset(asked)

    async def _park(self, state: AgentState, agent: AgentSpec, waiting: tuple[str, ...]) -> Waiting:
        """Park the turn until its calls in ``waiting`` are decided: saved as waiting (the
        lease let go), listed among the calls waiting for a decision, then
        ``approval.requested`` for each call. A turn parked already is listed and announced
        again as it was (the same events): the worker that parked it may have died before it
        could."""
        if turn_of(state).status != "waiting":
            state = await self._save(
                parked(state, waiting, self.clock(), agent.approval_timeout_s), release=True
            )
        await self.store.list_waiting(state)
        ex = turn_of(state)
        assert ex.wait is not None and ex.pending is not None and ex.pending.response is not None
        calls = {c.id: c for c in ex.pending.response.message.tool_calls}
        for call_id in waiting:
            call = calls[call_id]
            await self._emit(
                "approval.requested",
                ApprovalRequested(
                    call_id=call_id, tool=call.name, arguments=call.arguments, until=ex.wait.until
                ),
                state,
                step=ex.pending.index,
                call_id=call_id,
                at=ex.wait.since,
            )
        return Waiting(state, ex.wait.until)

    async def _resume(self, state: AgentState) -> AgentState:
        """Every call the turn waited on is decided: off the list of calls waiting for a
        decision (first: once the turn is saved going on, no step sees its wait again), then it
        goes on (saved as running again), with ``approval.decided`` for each decision."""
        await self.store.list_waiting(state)
        ex = turn_of(state)
        assert ex.pending is not None
        pending = ex.pending.model_copy(update={"dispatched_at": self.clock()})
        state = await self._save(
            with_execution(state, status="in_progress", wait=None, pending=pending)
        )
        for call_id, decision in pending.decisions.items():
            await self._emit(
                "approval.decided",
                ApprovalDecided(
                    call_id=call_id,
                    decision=decision.decision,
                    by=decision.by,
                    message=decision.message,
                ),
                state,
                step=pending.index,
                call_id=call_id,
                at=decision.at,
            )
        return state

    async def _throttle(self, state: AgentState, wait_s: float) -> Waiting:
        """Park the turn until the model may be asked again (a rate limit, a 429): saved as
        waiting, the lease let go; its timeout message wakes it."""
        now = self.clock()
        waiting = Wait(kind="throttled", since=now, until=now + wait_s)
        state = await self._save(
            with_execution(state, status="waiting", wait=waiting), release=True
        )
        if "turn.throttled" in self.announced:
            await announce_throttle(self.events, state)
        assert waiting.until is not None
        return Waiting(state, waiting.until)

    async def _rate_limited(
        self, agent: str, messages: Sequence[ChatMessage], max_tokens: int | None
    ) -> float:
        """The seconds this model call must wait (0: it goes now, charged) under its tenant's
        own rate limits and the endpoint's. The tenant's are asked first; refused, the
        endpoint's are not asked at all (a refused ask charges nothing, so the turn waits for
        its tenant's slot, then asks both again). Admitted, the endpoint's are asked, and when
        they refuse, the tenant's charge is given back: neither limit is ever charged for a
        call the other held back, so a tenant over its limit takes nothing of the endpoint's,
        and a busy endpoint costs a tenant nothing of its own. Over both, the turn waits for
        the one refusing first, then the other: at least the longer of the two."""
        own = None
        if self.tenant_limiter is not None:
            tenant = tenancy.current()
            own = self.tenant_limiter(tenant) if tenant is not None else None
        if own is not None:
            wait = await own.admit(messages, max_tokens)
            if wait > 0:
                observe(self.observer.throttled, agent, "tenant_rate_limit")
                return wait
        if self.limiter is not None:
            wait = await self.limiter.admit(messages, max_tokens)
            if wait > 0:
                if own is not None:
                    await own.refund(messages, max_tokens)
                observe(self.observer.throttled, agent, "rate_limit")
                return wait
        return 0.0

    async def _check_budgets(
        self, state: AgentState, agent: AgentSpec, index: int
    ) -> AgentState | Finished:
        """Before a model call: a spent budget makes this the turn's last call (saved, so a
        redone step makes the same one), or ends the turn at once when not even that fits."""
        ex = turn_of(state)
        today = None
        if self.ledger is not None and not agent.daily_budget.empty:
            today = await self.ledger.spent_today(ex.request.agent)
        tenant = self._tenant_budget()
        tenant_today = None
        if tenant is not None and self.ledger is not None:
            spent_today = await self.ledger.spent_today(tenant_ledger_name(tenant[0]))
            tenant_today = (tenant[1], spent_today)
        spent = first_spent(state, agent, self.clock(), today, tenant_today)
        if spent is None:
            return state
        observe(self.observer.budget_exhausted, ex.request.agent, spent.name)
        state = with_execution(
            state, budget_spent=spent.name, stop_signal=StopSignal(source=spent.name)
        )
        if spent.final_call:
            state = await self._save(state)
        exhausted = BudgetExhausted(
            budget=spent.name, limit=spent.limit, used=spent.used, final_call=spent.final_call
        )
        await self._emit("budget.exhausted", exhausted, state, step=index, at=ex.updated_at)
        if not spent.final_call:
            return await self.end(state, agent, "budget", ex.last_content)
        return state

    async def _structured(
        self,
        state: AgentState,
        agent: AgentSpec,
        reason: FinishReason,
        schema: dict[str, Any],
        record: StepExecution,
        unsaved: Sequence[ToolExecution],
        content: str | None,
    ) -> StepOutcome:
        """A final answer that must match a schema: the turn ends with its value, or the
        answer goes back to the model with the validation error, or (no repair left) the turn
        fails with ``invalid_output``."""
        ex = turn_of(state)
        value, error = parsed(schema, content)
        if error is None:
            return await self.end(
                state, agent, reason, content, step=record, invoked=unsaved, output=value
            )
        repairs_left = ex.output_repairs < agent.max_output_repairs
        if repairs_left and reason != "budget" and ex.step_count < ex.limits.max_tool_iterations:
            note = ChatMessage(role="user", content=REPAIR_NOTE.format(error=error))
            state = with_execution(state, output_repairs=ex.output_repairs + 1)
            state = await self._save(state, append=[note], release=True, step=record)
            await self._emit_step(state, record, invoked=unsaved)
            return RunAgain(state)
        failure = TurnError(code="invalid_output", message=f"invalid structured output: {error}")
        return await self.end(
            state, agent, "error", content, error=failure, step=record, invoked=unsaved
        )

    async def _save(
        self,
        state: AgentState,
        *,
        append: Sequence[ChatMessage] = (),
        release: bool = False,
        step: StepExecution | None = None,
    ) -> AgentState:
        """Save mid-turn; ``release`` on the step's last write; ``step``: the record of the
        step this save completes (counted in ``state`` already, ``with_step``)."""
        counted = with_appended(state, len(append), self.clock())
        return await self.store.save(counted, append=append, release=release, step=step)

    async def _emit_step(
        self, state: AgentState, record: StepExecution, *, invoked: Sequence[ToolExecution] = ()
    ) -> None:
        """``tool.invoked`` for results the step's save stored, then ``step.completed``."""
        for event in step_events(Subject.of_state(state), record, invoked, self.announced):
            await publish(self.events, event)

    async def _emit(
        self,
        event_type: EventType,
        data: EventData,
        state: AgentState,
        *,
        step: int | None = None,
        call_id: str = "",
        at: float | None = None,
        id_suffix: str = "",
    ) -> None:
        """Announce an event; ``at``: the time of the saved record it announces (so that one
        published again after a redelivery is the same event), else now. A type the worker
        does not publish (``LOOPWIRE_EVENTS``) is not built at all."""
        if event_type not in self.announced:
            return
        now = self.clock() if at is None else at
        await announce(
            self.events,
            now,
            event_type,
            data,
            state,
            step=step,
            call_id=call_id,
            id_suffix=id_suffix,
        )


async def announce_throttle(events: EventSink, state: AgentState) -> None:
    """``turn.throttled`` for a turn saved parked until the model may be asked again: the same
    event every time (its time and id are the wait's), so that one announced again, by the
    worker that takes the step message of a worker that died before announcing it, is a copy
    a subscriber drops."""
    ex = turn_of(state)
    wait = ex.wait
    assert wait is not None and wait.until is not None
    await announce(
        events,
        wait.since,
        "turn.throttled",
        TurnThrottled(until=wait.until),
        state,
        step=ex.pending.index if ex.pending is not None else ex.step_count,
        id_suffix=f"{wait.since:.6f}",
    )


def _tool_asks_approval(definition: ToolDefinition | None) -> bool:
    return definition is not None and definition.approval
