"""The model's answer saved (before any tool runs), or its failure; and the last phase of a
step: its results judged and recorded, then whether the turn goes on.

The empty-streak guard judges the results, ``after_step`` hooks run, and the step is recorded
with the stop or continuation a hook gave (a continuation overrides a stop of the same step,
not a spent budget; after a final answer it asks for one more step). The turn ends when the
model called no tool (through the structured-output judge when it asked for a schema), when a
hook stopped it, or at the iteration cap; else the step's last save lets the next step run.
``Loop`` (``worker.loop.engine``) mixes it in.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from contracts.events import ModelResponded
from contracts.messages import ChatMessage
from contracts.state import (
    AgentState,
    AgentStep,
    PendingStep,
    StepExecution,
    StopSignal,
    ToolExecution,
)
from contracts.turns import FinishReason, TurnError
from worker.errors import ModelError
from worker.loop.composer import Composer
from worker.loop.context import too_long
from worker.loop.guards import apply_empty_streak
from worker.loop.hooks import HookContext
from worker.loop.outcomes import Finished, ModelCall, RunAgain, StepOutcome, Waiting
from worker.loop.output import schema_of
from worker.loop.ports import observe
from worker.loop.spec import AgentSpec
from worker.loop.turn import recorded_step, turn_of, unique_call_ids, with_execution, with_step

log = logging.getLogger("loopwire.loop")

MAX_RETRY_AFTER_S = 300.0
"""A 429's Retry-After is honoured up to this long."""

DEADLINE_SLACK_S = 0.05
"""A model call that fails this close to the turn's deadline was cut by it."""


class Completion(Composer):
    """Mixed into ``Loop``: the model's answer and the step's completion."""

    __slots__ = ()

    announced: frozenset[str]

    async def _after_model(
        self, call: ModelCall, agent: AgentSpec
    ) -> RunAgain | Finished | Waiting:
        """Wait for the model's answer, then save it (before any tool runs)."""
        try:
            response = await call.answer
        except ModelError as exc:
            observe(
                self.observer.model_failed,
                call.model,
                exc.code,
                self.clock() - call.called,
                agent.models[-1].provider if agent.models else agent.provider or "default",
            )
            return await self._model_failed(call, agent, exc)
        observe(
            self.observer.model_called,
            response.model if response.provider else call.model,
            response.usage,
            self.clock() - call.called,
            response.provider or "default",
        )
        state = call.parked.unpark()
        ex = turn_of(state)
        ctx = HookContext(state=state, agent=agent, step=call.index)
        response = await self.hooks.after_model(ctx, response)
        response = unique_call_ids(response, call.taken, call.index)
        cost = self.price(call.model, response.usage)
        if cost:
            response = response.model_copy(update={"cost_usd": cost})
        content = response.message.content
        pending = PendingStep(
            index=call.index,
            started_at=call.started,
            input_count=call.input_count,
            response=response,
            offered=call.offered,
            dispatched_at=self.clock(),
            sent_tokens=call.sent_tokens,
            summarized=call.summarized,
        )
        if call.raw_tokens and response.usage.prompt_tokens and ex.request.persist:
            # what the estimate missed by, for the next one (``worker.loop.context``); a
            # persist: false turn leaves the session's ratio as it was
            ratio = response.usage.prompt_tokens / call.raw_tokens
            state = state.model_copy(update={"token_ratio": ratio})
        state = with_execution(
            state,
            pending=pending,
            usage=ex.usage + response.usage,
            cost_usd=ex.cost_usd + cost,
            last_content=content if content else ex.last_content,
            stop_signal=ex.stop_signal or ctx.stop_signal,
            context_forced=False,
        )
        saved = await self._save(state, append=[response.message])
        if call.held is not None:  # the text as the hooks left it, as saved
            await call.held.replay(content or "")
        if "model.responded" in self.announced:
            await self._emit(
                "model.responded",
                ModelResponded(
                    model=response.model,
                    finish_reason=response.finish_reason,
                    usage=response.usage,
                    duration_s=response.duration_s,
                ),
                saved,
                step=call.index,
                at=pending.dispatched_at,
            )
        return RunAgain(saved)

    async def _complete_step(
        self, state: AgentState, agent: AgentSpec, unsaved: Sequence[ToolExecution] = ()
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
        step, tool_messages = recorded_step(pending, executions)
        ctx = HookContext(state=state, agent=agent, step=pending.index)
        await self.hooks.after_step(ctx, step)
        now = self.clock()
        stop = ex.stop_signal or ctx.stop_signal
        more = ctx.continuation if ex.budget_spent is None else None
        if more is not None or stop is not None:
            step = step.model_copy(
                update={
                    "stopped_by": stop.source if stop is not None else None,
                    "continued_by": more.source if more is not None else None,
                }
            )
            if more is not None:
                stop = None  # a continuation overrides a stop of the same step
        record = StepExecution(step=step, started_at=pending.started_at, completed_at=now)
        state = with_step(state, record, pending=None, empty_streak=streak, stop_signal=stop)
        agent_name = ex.request.agent
        outcome: StepOutcome
        if not calls and more is not None and ex.step_count + 1 < ex.limits.max_tool_iterations:
            # a final answer, and a hook asks for one more step (a self-check)
            note = [ChatMessage(role="user", content=more.message)] if more.message else []
            state = await self._save(state, append=note, release=True, step=record)
            await self._emit_step(state, record, invoked=unsaved)
            outcome = RunAgain(state)
        elif not calls:
            # an answer cut short by the model's token limit ends the turn with what it said,
            # and says so: it is not mistaken for a whole answer
            reason: FinishReason = "length" if response.finish_reason == "length" else "stop"
            if ex.budget_spent is not None:
                reason = "budget"
            schema = schema_of(agent, ex)
            if schema is None or reason == "length":
                outcome = await self.end(
                    state, agent, reason, response.message.content, step=record, invoked=unsaved
                )
            else:
                outcome = await self._structured(
                    state, agent, reason, schema, record, unsaved, response.message.content
                )
        elif stop is not None:
            outcome = await self.end(
                state,
                agent,
                "budget" if ex.budget_spent is not None else "stop",
                ex.last_content,
                append=tool_messages,
                step=record,
                invoked=unsaved,
            )
        elif ex.step_count + 1 >= ex.limits.max_tool_iterations:
            outcome = await self.end(
                state,
                agent,
                "max_iterations",
                ex.last_content,
                append=tool_messages,
                step=record,
                invoked=unsaved,
            )
            observe(self.observer.iteration_cap_hit, agent_name)
        else:
            # the step's last write: it also lets go of what the store holds for the step
            state = await self._save(state, append=tool_messages, release=True, step=record)
            await self._emit_step(state, record, invoked=unsaved)
            outcome = RunAgain(state)
        if hints:
            observe(self.observer.empty_streak_hints, agent_name, hints)
        observe(self.observer.step_completed, agent_name, record.duration_s)
        return outcome

    async def _model_failed(
        self, call: ModelCall, agent: AgentSpec, exc: ModelError
    ) -> Finished | Waiting | RunAgain:
        """A model call that failed for good ends the turn with ``error``; the step is recorded
        with its error (and announced, ``step.completed``). A 429 parks the turn instead, for
        as long as the endpoint asked."""
        state = call.parked.unpark()
        ex = turn_of(state)
        if too_long(str(exc)) and not ex.context_forced:
            # the request did not fit the model's context: once more, with half of it
            log.warning("the model found turn %s's request too long: trimming it", ex.turn_id)
            forced = with_execution(state, context_forced=True)
            return RunAgain(await self._save(forced, release=True))
        if exc.retry_after is not None:
            observe(self.observer.throttled, ex.request.agent, "429")
            return await self._throttle(state, min(exc.retry_after, MAX_RETRY_AFTER_S))
        deadline = ex.request.deadline
        if deadline is not None and self.clock() >= deadline - DEADLINE_SLACK_S:
            # the call was cut at the turn's deadline: the turn is out of time, not failed
            late = with_execution(state, stop_signal=StopSignal(source="deadline"))
            return await self.end(late, agent, "cancelled", ex.last_content)
        log.warning("model call failed for turn %s: %s", ex.turn_id, exc)
        message = str(exc)[:4000]
        step = AgentStep(index=call.index, input_count=call.input_count, errors=(message,))
        record = StepExecution(step=step, started_at=call.started, completed_at=self.clock())
        state = with_step(state, record, pending=None)
        error = TurnError(code=exc.code, message=message)
        return await self.end(state, agent, "error", ex.last_content, error=error, step=record)
