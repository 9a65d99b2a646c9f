"""The turn loop, one step at a time.

``Loop.step(state, agent)`` advances a turn by exactly one step and returns a
closed union: ``RunAgain`` (publish the next step) or ``Finished`` (the turn's
result). Between its phases it saves through the ``StateStore`` so that a step
interrupted anywhere resumes from the last saved point when it is run again:

1. start (first step only): ``before_execution`` hooks, input messages recorded;
2. model: ``before_step``, compile (system prompt + history + this turn),
   ``prepare_messages``, call the model, ``after_model``; the assistant message
   is saved (even when empty) before any tool runs — a saved response is never
   asked for again;
3. tools: every call without a saved result runs concurrently; each result is
   saved as it arrives (the last one by the step's own save, which follows at
   once) — a saved result is never dispatched again;
4. complete: results in call order, empty-streak guard, ``after_step``, then
   stop when the model called no tool, a hook asked to stop, or the iteration
   cap was reached.

Every way a turn ends goes through ``Loop.end``. The same code serves an in-process turn
(``run_turn``) and the distributed worker, which runs one step per delivery.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from contracts.events import (
    DEFAULT_EVENTS,
    ModelRequested,
    TurnFinished,
    finish_event_type,
)
from contracts.messages import ChatMessage
from contracts.state import (
    AgentState,
    StepExecution,
    ToolExecution,
    Wait,
)
from contracts.turns import Budget, FinishReason, TurnError, TurnRequest
from worker.loop.announce import delta_publisher, ended_step
from worker.loop.approvals import undecided
from worker.loop.budgets import configured, own_spend, tenant_ledger_name
from worker.loop.children import agent_tools, unanswered_children
from worker.loop.completion import Completion
from worker.loop.hooks import Hook, HookContext, rewrites_answer
from worker.loop.outcomes import Finished, ModelCall, Phase, RunAgain, StepOutcome, Waiting
from worker.loop.ports import (
    EventSink,
    LoopObserver,
    Model,
    Price,
    RateLimiter,
    RefundableLimiter,
    SpendLedger,
    StateStore,
    ToolCaller,
    ToolCatalog,
    free,
    observe,
)
from worker.loop.request import compile_messages, model_request
from worker.loop.spec import AgentSpec
from worker.loop.streaming import DEFAULT_STREAM, StepStream, StreamSettings
from worker.loop.tools import ToolRunner
from worker.loop.turn import (
    closed,
    new_execution,
    turn_of,
    turn_result,
    unanswered,
    with_execution,
)

log = logging.getLogger("loopwire.loop")


class Loop(Completion):
    """Runs steps of turns over the injected model, tools, store, events and hooks."""

    __slots__ = (
        "announced",
        "catalog",
        "clock",
        "events",
        "hooks",
        "ledger",
        "limiter",
        "model",
        "observer",
        "price",
        "redone",
        "store",
        "stream_settings",
        "tenant_budget",
        "tenant_limiter",
        "tools",
    )

    def __init__(
        self,
        *,
        model: Model,
        tools: ToolCaller,
        catalog: ToolCatalog,
        store: StateStore,
        events: EventSink,
        hooks: Hook | None = None,
        observer: LoopObserver | None = None,
        clock: Callable[[], float] = time.time,
        price: Price = free,
        ledger: SpendLedger | None = None,
        limiter: RateLimiter | None = None,
        announced: frozenset[str] = frozenset(DEFAULT_EVENTS),
        stream_settings: StreamSettings = DEFAULT_STREAM,
        redone: bool = False,
        tenant_budget: Callable[[str], Budget] | None = None,
        tenant_limiter: Callable[[str], RefundableLimiter | None] | None = None,
    ) -> None:
        self.tenant_budget = tenant_budget
        """A tenant's daily budget (tenancy on; none: tenants have none)."""
        self.tenant_limiter = tenant_limiter
        """A tenant's own model rate limits (tenancy on; none: no tenant has any, and
        nothing is asked)."""
        self.announced = announced
        self.stream_settings = stream_settings
        """How a streamed answer's deltas are coalesced."""
        self.redone = redone
        """The step may have run before (its message was redelivered): a streamed answer's
        first delta says ``restarted``."""
        """The event types published (``LOOPWIRE_EVENTS``): the opt-in ones are not even built
        unless named."""
        self.model = model
        self.limiter = limiter
        """The model endpoint's fleet-wide rate limits (none: not limited)."""
        self.price = price
        """The cost of a model call's usage (the workers' price table)."""
        self.ledger = ledger
        """Each agent's spend per day, for daily budgets (none: they are not checked)."""
        self.catalog = catalog
        self.store = store
        self.events = events
        self.hooks = hooks or Hook()
        self.observer = observer or LoopObserver()
        self.clock = clock
        self.tools = ToolRunner(
            caller=tools, hooks=self.hooks, emit=self._emit, clock=clock, observer=self.observer
        )

    def step(self, state: AgentState, agent: AgentSpec) -> Awaitable[StepOutcome]:
        """Advance the turn attached to ``state`` by one step.

        The state goes to the phase that runs before the model call; that phase ends before the
        model is awaited, so while the model thinks only the store's parked copy of the state is
        held (``StateStore.park``). A workflow's step runs no model (``Composer._flow_step``)."""
        if agent.workflow is not None:
            return self._flow_step(state, agent)
        return self._step(self._before_model(state, agent), agent)

    async def run_turn(
        self, state: AgentState | None, request: TurnRequest, agent: AgentSpec
    ) -> Finished:
        """Run a whole turn in this process, step after step."""
        current = await self.store.save(new_execution(state, request, agent, self.clock()))
        while True:
            outcome = await self.step(current, agent)
            if isinstance(outcome, Finished):
                return outcome
            if isinstance(outcome, Waiting):
                raise RuntimeError("the turn waits for approval: only workers can resume it")
            current = outcome.state

    async def _step(self, ready: Awaitable[Phase], agent: AgentSpec) -> StepOutcome:
        phase = await ready
        if isinstance(phase, ModelCall):
            phase = await self._after_model(phase, agent)
            if isinstance(phase, RunAgain) and turn_of(phase.state).pending is None:
                return phase  # the step is to be sent again (its request was too long)
        if isinstance(phase, Finished | Waiting):
            return phase
        if self.store.cancelled():
            # a cancel came while the model thought: no tool goes out; the step goes back with
            # its saved answer, and its turn is ended for the cancel
            return phase
        state = phase.state
        ex = turn_of(state)
        if ex.pending is not None and ex.stop_signal is None and _gated_by_approval(ex.wait):
            waiting = undecided(ex.pending, agent, await self._hook_asks(state, agent))
            if waiting:
                return await self._park(state, agent, waiting)
            if ex.status == "waiting":
                state = await self._resume(state)
        state, unsaved = await self.tools.run_pending(state, agent, self.catalog, self.store)
        if agent.agents:  # its calls to sub-agents run as child turns
            gated = await self._children(state, agent, unsaved)
            if isinstance(gated, Waiting):
                return gated
            state, unsaved = gated
        return await self._complete_step(state, agent, unsaved)

    # -- phases ---------------------------------------------------------------

    async def _before_model(self, state: AgentState, agent: AgentSpec) -> Phase:
        """Start the turn (first step), check its deadline, and send the model its request; or,
        when the model's answer is saved already, go straight to the tools."""
        opened = await self._opened(state, agent)
        if isinstance(opened, Finished):
            return opened
        state, ex = opened, turn_of(opened)
        if ex.pending is not None:
            if ex.status == "waiting":
                return RunAgain(state)  # parked: the approval gate decides what happens
            response = ex.pending.response
            if response is not None and self._streams(agent, state):  # re-streamed, saved
                await self._stream(state, ex.pending.index, True).replay(
                    response.message.content or ""
                )
            return RunAgain(await self._redispatch(state))
        if ex.status == "waiting":  # throttled, and its slot has come: on to the model
            state = await self._save(with_execution(state, status="in_progress", wait=None))
        return await self._ask_model(state, agent)

    async def _ask_model(self, state: AgentState, agent: AgentSpec) -> Phase:
        """``before_step``, the budgets, the messages, the rate limits, then the model call."""
        ex = turn_of(state)
        index = ex.step_count
        ctx = HookContext(state=state, agent=agent, step=index)
        await self.hooks.before_step(ctx)
        if ctx.stop_signal is not None:
            stopped = with_execution(state, stop_signal=ctx.stop_signal)
            return await self.end(stopped, agent, "stop", ex.last_content)
        started = self.clock()
        budgeted = configured(agent, ex) or self._tenant_budget() is not None
        if ex.budget_spent is None and budgeted:
            checked = await self._check_budgets(state, agent, index)
            if isinstance(checked, Finished):
                return checked
            state = checked
            ex = turn_of(state)
        messages, taken = await compile_messages(self.store, self.hooks, state, agent, ctx)
        if ctx.stop_signal is not None:  # e.g. a guard judged the input: no model call
            stopped = with_execution(state, stop_signal=ctx.stop_signal)
            return await self.end(stopped, agent, "stop", ex.last_content)
        fitted = None
        if agent.context.max_tokens is not None or ex.context_forced:
            fitted = await self._fit(state, agent, messages)
            state, messages = fitted.state, fitted.messages
            ex = turn_of(state)
        if ex.budget_spent is None:
            offered = [d for d in await self.catalog.available() if agent.allows(d.name)]
            if agent.agents:  # the agents it may call are tools too (and win a clash of names)
                offered = [d for d in offered if agent.sub_agent(d.name) is None]
                offered += agent_tools(agent)
        else:  # the last call of a spent budget: no tools, and a note to answer now
            offered = []
            messages = [*messages, ChatMessage(role="user", content=agent.budget_note)]
        stream = self._stream(state, index, self.redone) if self._streams(agent, state) else None
        held = stream if stream is not None and rewrites_answer(self.hooks) else None
        live = None if held is not None else stream
        request = model_request(state, agent, messages, offered, self.clock(), live)
        if self.limiter is not None or self.tenant_limiter is not None:
            wait = await self._rate_limited(ex.request.agent, messages, request.max_tokens)
            if wait > 0:
                return await self._throttle(state, wait)
        if "model.requested" in self.announced:
            await self._emit(
                "model.requested",
                ModelRequested(
                    model=request.model,
                    messages=len(messages),
                    estimated_tokens=fitted.tokens if fitted is not None else None,
                ),
                state,
                step=index,
            )
        return ModelCall(
            parked=self.store.park(state),
            answer=self.model.complete(request),
            model=request.model,
            index=index,
            input_count=len(messages),
            offered=tuple(d.name for d in offered),
            started=started,
            called=self.clock(),
            sent_tokens=fitted.tokens if fitted is not None else None,
            raw_tokens=fitted.raw_tokens if fitted is not None else None,
            summarized=fitted.summarized if fitted is not None else False,
            held=held,
            taken=taken,
        )

    def _streams(self, agent: AgentSpec, state: AgentState) -> bool:
        """Whether this turn's answers are streamed: the request says so, or else the profile;
        never when ``message.delta`` is not published."""
        wanted = turn_of(state).request.stream
        return (agent.stream if wanted is None else wanted) and "message.delta" in self.announced

    def _stream(self, state: AgentState, index: int, restarted: bool) -> StepStream:
        publish = delta_publisher(self.events, state, index, self.clock)
        return StepStream(publish, self.stream_settings, restarted=restarted)

    async def _redispatch(self, state: AgentState) -> AgentState:
        """The tool phase is redone (the worker that saved the model's answer did not finish
        it): the next round of dispatches is saved before any call goes out again, so that
        ``tool.invoking`` counts real dispatches."""
        pending = turn_of(state).pending
        assert pending is not None and pending.response is not None
        calls = pending.response.message.tool_calls
        if all(pending.result_for(c.id) is not None for c in calls):
            return state
        again = pending.model_copy(
            update={"dispatches": pending.dispatches + 1, "dispatched_at": self.clock()}
        )
        return await self._save(with_execution(state, pending=again))

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
        """End the turn: the one path every ending takes — the model answered, the iteration
        cap, a hook's stop, the deadline, a failed model call, and a step that can never
        succeed (the worker ends it with ``error``). ``after_execution`` hooks run, the observer
        hears of it, the result is stored with the closed session (the store drops the turn's
        transient messages and lets go of the session, naming its next turn), then the events:
        ``step.completed`` for the step that ended it, if any, and the turn's end. A turn ended
        while its step's tool calls were out gets a tool message for each of them in the history
        (the saved result, or an error saying it was not run), so that the conversation the
        model sees next stays well-formed. ``rollback`` (a cancel that asked for it): what the
        turn added to the history is removed in the same save, its messages and records of
        steps otherwise kept as for any ended turn."""
        ex = turn_of(state)
        orphans = unanswered_children(state)
        rollback = rollback and ex.request.persist
        if rollback:
            append = ()
        elif ex.pending is not None and agent.workflow is None:
            # ended mid-step: no call in the history without its result (a workflow's calls
            # are not in its history)
            append = (*append, *unanswered(ex.pending, reason))
        now = self.clock()
        result = turn_result(state, reason, content, error, now, output)
        try:
            await self.hooks.after_execution(
                HookContext(state=state, agent=agent, step=ex.step_count), result
            )
        except Exception:
            if reason != "error":
                raise  # the step is redone
            # a turn ending with an error ends even when a hook fails (it may be why)
            log.exception("after_execution hook failed for turn %s", ex.turn_id)
        persist = ex.request.persist
        final = closed(state, appended=len(append) if persist else 0, now=now)
        if rollback:
            final = final.model_copy(update={"history_len": ex.history_start})
        if step is not None:  # its events can be announced again with the end
            ended = ended_step(ex.turn_id, step, invoked)
            final = final.model_copy(update={"ended_step": ended})
        saved = await self.store.save(
            final,
            append=append if persist else (),
            result=result,
            step=step,
            cut_to=ex.history_start if rollback else None,
        )
        if self.ledger is not None and not agent.daily_budget.empty:
            await self.ledger.add_spent(ex.request.agent, own_spend(ex, now))
        tenant = self._tenant_budget()
        if self.ledger is not None and tenant is not None:
            await self.ledger.add_spent(tenant_ledger_name(tenant[0]), own_spend(ex, now))
        observe(self.observer.turn_finished, result)
        if step is not None:
            await self._emit_step(state, step, invoked=invoked)
        await self._emit(
            finish_event_type(reason), TurnFinished(result=result), state, at=result.completed_at
        )
        return Finished(saved, result, orphans, ex.trace)


def _gated_by_approval(wait: Wait | None) -> bool:
    """Whether the step's calls pass the approval gate now (not while it waits on children)."""
    return wait is None or wait.kind == "approval"
