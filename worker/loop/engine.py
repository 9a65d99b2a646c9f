"""The turn loop, one step at a time.

``Loop.step(state, profile)`` advances a turn by exactly one step and returns a
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

The same code serves an in-process turn (``run_turn``) and the distributed
worker, which runs one step per delivery.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from contracts.events import (
    EventData,
    EventType,
    StepCompleted,
    TurnFinished,
    TurnStarted,
    finish_event_type,
)
from contracts.messages import ChatMessage, Usage
from contracts.state import (
    AgentState,
    AgentStep,
    PendingStep,
    StepExecution,
    StopSignal,
    ToolExecution,
)
from contracts.turns import FinishReason, TurnError, TurnRequest, TurnResult
from worker.agents import AgentProfile
from worker.errors import ModelError
from worker.loop.announce import announce
from worker.loop.guards import apply_empty_streak
from worker.loop.hooks import Hook, HookContext
from worker.loop.ports import (
    EventSink,
    LoopObserver,
    Model,
    StateStore,
    ToolCaller,
    ToolCatalog,
    observe,
)
from worker.loop.records import (
    Parked,
    closed,
    new_execution,
    turn_of,
    turn_result,
    unique_call_ids,
    with_execution,
)
from worker.loop.request import compile_messages, model_request
from worker.loop.tools import ToolRunner

log = logging.getLogger("loopwire.loop")


@dataclass(frozen=True, slots=True)
class RunAgain:
    """The turn goes on: run the next step."""

    state: AgentState


@dataclass(frozen=True, slots=True)
class Finished:
    """The turn is over."""

    state: AgentState
    result: TurnResult


StepOutcome = RunAgain | Finished


class Loop:
    """Runs steps of turns over the injected model, tools, store, events and hooks."""

    __slots__ = ("catalog", "clock", "events", "hooks", "model", "observer", "store", "tools")

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
    ) -> None:
        self.model = model
        self.catalog = catalog
        self.store = store
        self.events = events
        self.hooks = hooks or Hook()
        self.observer = observer or LoopObserver()
        self.clock = clock
        self.tools = ToolRunner(
            caller=tools, hooks=self.hooks, emit=self._emit, clock=clock, observer=self.observer
        )

    async def step(self, state: AgentState, profile: AgentProfile) -> StepOutcome:
        """Advance the turn attached to ``state`` by one step."""
        ex = turn_of(state)
        if ex.status == "pending":
            state = await self._start(state, profile)
            ex = turn_of(state)
            if ex.stop_signal is not None:
                return await self._finish(state, profile, "stop", ex.last_content)
        deadline = ex.request.deadline
        if deadline is not None and self.clock() > deadline and ex.pending is None:
            return await self._finish(state, profile, "cancelled", ex.last_content)
        if ex.pending is None:
            calling = self._call_model(state, profile)
            del state, ex  # the call holds the state as bytes while the model thinks
            outcome = await calling
            if isinstance(outcome, Finished):
                return outcome
            state = outcome.state
        state, unsaved = await self.tools.run_pending(state, profile, self.catalog, self.store)
        return await self._complete_step(state, profile, unsaved)

    async def run_turn(
        self, state: AgentState | None, request: TurnRequest, profile: AgentProfile
    ) -> Finished:
        """Run a whole turn in this process, step after step."""
        current = await self.store.save(new_execution(state, request, profile, self.clock()))
        while True:
            outcome = await self.step(current, profile)
            if isinstance(outcome, Finished):
                return outcome
            current = outcome.state

    # -- phases ---------------------------------------------------------------

    async def _start(self, state: AgentState, profile: AgentProfile) -> AgentState:
        ex = turn_of(state)
        ctx = HookContext(state=state, profile=profile, step=0)
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
                history_len=ex.history_start, max_tool_iterations=ex.limits.max_tool_iterations
            ),
            state,
        )
        observe(self.observer.turn_started, ex.request.agent)
        return state

    async def _call_model(self, state: AgentState, profile: AgentProfile) -> StepOutcome:
        ex = turn_of(state)
        index = len(ex.steps)
        ctx = HookContext(state=state, profile=profile, step=index)
        await self.hooks.before_step(ctx)
        if ctx.stop_signal is not None:
            stopped = with_execution(state, stop_signal=ctx.stop_signal)
            return await self._finish(stopped, profile, "stop", ex.last_content)
        started = self.clock()
        messages = await compile_messages(self.store, self.hooks, state, profile, ctx)
        offered = [d for d in await self.catalog.available() if profile.allows(d.name)]
        # While the model thinks only the adapter holds the history, and the state is held as
        # bytes (``Parked``): nothing here keeps the objects of either.
        parked, stop = Parked(state, self.store.stored(state)), ctx.stop_signal
        reload = partial(self._compile_again, parked, profile, index, stop)
        request = model_request(state, profile, messages, offered, reload)
        model_name, input_count, turn_id = request.model, len(messages), ex.turn_id
        names = tuple(d.name for d in offered)
        call = self.model.complete(request)
        del request, messages, offered, state, ex, ctx
        called = self.clock()
        try:
            response = await call
        except ModelError as exc:
            observe(self.observer.model_failed, model_name, exc.code, self.clock() - called)
            log.warning("model call failed for turn %s: %s", turn_id, exc)
            error = TurnError(code=exc.code, message=str(exc)[:4000])
            state = parked.state()
            last = turn_of(state).last_content
            return await self._finish(state, profile, "error", last, error=error)
        observe(self.observer.model_called, model_name, response.usage, self.clock() - called)
        state = parked.state()
        ex = turn_of(state)
        ctx = HookContext(state=state, profile=profile, step=index, stop_signal=stop)
        response = await self.hooks.after_model(ctx, response)
        response = unique_call_ids(response, ex, index)
        content = response.message.content
        pending = PendingStep(
            index=index,
            started_at=started,
            input_count=input_count,
            response=response,
            offered=names,
        )
        state = with_execution(
            state,
            pending=pending,
            usage=ex.usage + response.usage,
            last_content=content if content else ex.last_content,
            stop_signal=ex.stop_signal or ctx.stop_signal,
        )
        return RunAgain(await self._save(state, append=[response.message]))

    async def _compile_again(
        self, parked: Parked, profile: AgentProfile, index: int, stop: StopSignal | None
    ) -> Sequence[ChatMessage]:
        """The model request's messages built again (the adapter's retries), from the parked
        state; a stop a hook asks for here is not taken (it asked already, or not, the first
        time)."""
        state = parked.state()
        ctx = HookContext(state=state, profile=profile, step=index, stop_signal=stop)
        return await compile_messages(self.store, self.hooks, state, profile, ctx)

    async def _complete_step(
        self, state: AgentState, profile: AgentProfile, unsaved: Sequence[ToolExecution] = ()
    ) -> StepOutcome:
        """Judge the results and record the step; ``unsaved`` are results that this step's save
        stores (announced once it did)."""
        ex = turn_of(state)
        pending = ex.pending
        assert pending is not None and pending.response is not None
        response = pending.response
        calls = response.message.tool_calls
        results = [pending.result_for(call.id) for call in calls]
        executions, streak, hints = apply_empty_streak(
            [r for r in results if r is not None], ex.empty_streak, ex.limits
        )
        tool_messages = [ChatMessage.tool(e.call_id, e.content) for e in executions]
        # Once judged, a value too large for the model is not kept in the state: the truncated
        # content is what the model saw; the full value would only grow every later save.
        executions = [
            e.model_copy(update={"value": None}) if e.truncated else e for e in executions
        ]
        step = AgentStep(
            index=pending.index,
            input_count=pending.input_count,
            output_messages=(response.message, *tool_messages),
            response=response,
            tool_executions=tuple(executions),
        )
        ctx = HookContext(state=state, profile=profile, step=pending.index)
        await self.hooks.after_step(ctx, step)
        now = self.clock()
        record = StepExecution(step=step, started_at=pending.started_at, completed_at=now)
        stop = ex.stop_signal or ctx.stop_signal
        state = with_execution(
            state, steps=(*ex.steps, record), pending=None, empty_streak=streak, stop_signal=stop
        )
        agent = ex.request.agent
        outcome: StepOutcome
        if not calls:
            outcome = await self._finish(
                state, profile, "stop", response.message.content, step=record, invoked=unsaved
            )
        elif stop is not None:
            outcome = await self._finish(
                state,
                profile,
                "stop",
                ex.last_content,
                append=tool_messages,
                step=record,
                invoked=unsaved,
            )
        elif len(ex.steps) + 1 >= ex.limits.max_tool_iterations:
            outcome = await self._finish(
                state,
                profile,
                "max_iterations",
                ex.last_content,
                append=tool_messages,
                step=record,
                invoked=unsaved,
            )
            observe(self.observer.iteration_cap_hit, agent)
        else:
            # the step's last write: it also lets go of what the store holds for the step
            state = await self._save(state, append=tool_messages, release=True)
            await self._emit_step(state, record, invoked=unsaved)
            outcome = RunAgain(state)
        if hints:
            observe(self.observer.empty_streak_hints, agent, hints)
        observe(self.observer.step_completed, agent, record.duration_s)
        return outcome

    async def _finish(
        self,
        state: AgentState,
        profile: AgentProfile,
        reason: FinishReason,
        content: str | None,
        *,
        error: TurnError | None = None,
        append: Sequence[ChatMessage] = (),
        step: StepExecution | None = None,
        invoked: Sequence[ToolExecution] = (),
    ) -> Finished:
        ex = turn_of(state)
        now = self.clock()
        result = turn_result(state, reason, content, error, now)
        await self.hooks.after_execution(
            HookContext(state=state, profile=profile, step=len(ex.steps)), result
        )
        persist = ex.request.persist
        final = closed(state, appended=len(append) if persist else 0, now=now)
        saved = await self.store.save(final, append=append if persist else (), result=result)
        observe(self.observer.turn_finished, result)
        if step is not None:
            await self._emit_step(state, step, invoked=invoked)
        await self._emit(finish_event_type(reason), TurnFinished(result=result), state)
        return Finished(saved, result)

    # -- helpers --------------------------------------------------------------

    async def _save(
        self, state: AgentState, *, append: Sequence[ChatMessage] = (), release: bool = False
    ) -> AgentState:
        """Save mid-turn, counting appended messages into the turn and (when persisted) the
        session; ``release`` on the step's last write."""
        ex = turn_of(state)
        changes: dict[str, object] = {"updated_at": self.clock()}
        update: dict[str, object] = {}
        if append:
            changes["message_count"] = ex.message_count + len(append)
            if ex.request.persist:
                update["history_len"] = state.history_len + len(append)
        update["execution"] = ex.model_copy(update=changes)
        return await self.store.save(
            state.model_copy(update=update), append=append, release=release
        )

    async def _emit_step(
        self, state: AgentState, record: StepExecution, *, invoked: Sequence[ToolExecution] = ()
    ) -> None:
        """``tool.invoked`` for results the step's save stored, then ``step.completed``."""
        step = record.step
        for execution in invoked:
            await self.tools.emit_invoked(state, step.index, execution)
        response = step.response
        await self._emit(
            "step.completed",
            StepCompleted(
                step_type=step.type,
                finish_reason=response.finish_reason if response else "error",
                tool_calls=len(step.tool_executions),
                usage=response.usage if response else Usage(),
                duration_s=record.duration_s,
                model_duration_s=response.duration_s if response else 0.0,
            ),
            state,
            step=step.index,
        )

    async def _emit(
        self,
        event_type: EventType,
        data: EventData,
        state: AgentState,
        *,
        step: int | None = None,
        call_id: str = "",
    ) -> None:
        await announce(
            self.events, self.clock(), event_type, data, state, step=step, call_id=call_id
        )
