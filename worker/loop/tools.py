"""The tool phase of a step: run every call that has no saved result, concurrently.

Nothing a tool does escapes as an exception: an unknown tool, arguments that are
not a JSON object, a blocked call, a timeout, an unreachable tool service or an
exception in the tool all become an error result the model reads as
``{"error": "..."}``. Each result is saved the moment it arrives: the last one of
the step by the step's own save, which follows at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NamedTuple, Protocol

from contracts import tenancy
from contracts.events import EventData, EventType, ToolInvoking
from contracts.messages import ToolCall
from contracts.state import (
    AgentState,
    ExecutionState,
    ToolExecution,
    ToolOutcome,
)
from contracts.tools import (
    ToolCallReply,
    ToolCallRequest,
    ToolContext,
    ToolDefinition,
    idempotency_key,
)
from worker.errors import RetryableError, ToolCallError, ToolUnavailableError
from worker.loop.announce import result_events
from worker.loop.guards import truncate
from worker.loop.hooks import Blocked, Hook, HookContext, ToolInvocation
from worker.loop.ports import (
    UNKNOWN_TOOL,
    LoopObserver,
    StateStore,
    ToolCaller,
    ToolCallOutcome,
    ToolCatalog,
    observe,
)
from worker.loop.spec import AgentSpec
from worker.loop.tool_calls import (
    Refused,
    call_arguments,
    error_content,
    shared_state,
    value_content,
)
from worker.loop.turn import turn_of

log = logging.getLogger("loopwire.tools")


class Emit(Protocol):
    def __call__(
        self,
        event_type: EventType,
        data: EventData,
        state: AgentState,
        *,
        step: int | None = None,
        call_id: str = "",
        at: float | None = None,
        id_suffix: str = "",
    ) -> Awaitable[None]: ...


class _Failed(NamedTuple):
    """A call that got no reply: the message for the model, the outcome for observers."""

    error: str
    outcome: ToolCallOutcome


class ToolPhase(NamedTuple):
    """The state after the tool phase, and the executions in it that are not saved yet."""

    state: AgentState
    unsaved: tuple[ToolExecution, ...]


class ToolRunner:
    __slots__ = ("caller", "clock", "emit", "hooks", "observer")

    def __init__(
        self,
        *,
        caller: ToolCaller,
        hooks: Hook,
        emit: Emit,
        clock: Callable[[], float],
        observer: LoopObserver | None = None,
    ) -> None:
        self.caller = caller
        self.hooks = hooks
        self.emit = emit
        self.clock = clock
        self.observer = observer or LoopObserver()

    async def run_pending(
        self, state: AgentState, agent: AgentSpec, catalog: ToolCatalog, store: StateStore
    ) -> ToolPhase:
        """Run every call of the pending step that has no saved result.

        Each result is saved as it arrives while other calls still run; the result that
        completes the step is not saved here but returned in ``unsaved``: the step's own save,
        which follows at once, stores it (one write fewer per step), and whoever makes that save
        announces it (``tool.invoked``) after it."""
        ex = turn_of(state)
        pending = ex.pending
        assert pending is not None and pending.response is not None
        todo = [c for c in pending.response.message.tool_calls if pending.result_for(c.id) is None]
        if agent.agents:  # calls to sub-agents are the children gate's (worker.loop.composer)
            todo = [c for c in todo if agent.sub_agent(c.name) is None]
        if not todo:
            return ToolPhase(state, ())
        offered = {d.name: d for d in await catalog.available() if agent.allows(d.name)}
        current = state
        running = len(todo)
        unsaved: list[ToolExecution] = []
        lock = asyncio.Lock()

        async def run_one(call: ToolCall) -> None:
            nonlocal current, running
            ctx = HookContext(state=current, agent=agent, step=pending.index)
            execution, updates, failed_as = await self._execute(ctx, call, offered, catalog)
            observe(
                self.observer.tool_executed,
                call.name if call.name in offered or call.name in pending.offered else UNKNOWN_TOOL,
                failed_as or execution.outcome,
                execution.duration_s,
            )
            async with lock:
                running -= 1
                recorded = _record(current, execution, updates, ctx, self.clock())
                if not running:
                    current = recorded
                    unsaved.append(execution)
                    return
                current = await store.save(recorded)
            await self.emit_invoked(current, pending.index, execution)

        if len(todo) == 1:
            await run_one(todo[0])  # no task group for the common single call
            return ToolPhase(current, tuple(unsaved))
        try:
            async with asyncio.TaskGroup() as group:
                for call in todo:
                    group.create_task(run_one(call))
        except BaseExceptionGroup as failed:
            # A failed save (StaleStateError, a lost Redis connection) must reach the caller as
            # itself, as it does from every other phase, so that it is classified (retried).
            raise _first_leaf(failed) from failed
        return ToolPhase(current, tuple(unsaved))

    async def _execute(
        self,
        ctx: HookContext,
        call: ToolCall,
        offered: Mapping[str, ToolDefinition],
        catalog: ToolCatalog,
    ) -> tuple[ToolExecution, dict[str, Any], ToolCallOutcome | None]:
        """The call's execution, the state updates it returned, and how it failed when it got
        no reply (``timeout``, ``unavailable``, ``error``); None when it was answered."""
        started = self.clock()
        ex = turn_of(ctx.state)
        round_ = ex.pending
        attempt = round_.dispatches if round_ is not None else 1
        # from the saved round: published again after a redelivery, it is the same event; a
        # real second dispatch is another one (its own id)
        await self.emit(
            "tool.invoking",
            ToolInvoking(tool=call.name, call_id=call.id, attempt=attempt),
            ctx.state,
            step=ctx.step,
            call_id=call.id,
            at=round_.dispatched_at if round_ is not None and round_.dispatched_at else None,
            id_suffix="" if attempt == 1 else f"#{attempt}",
        )

        def finish(
            outcome: ToolOutcome,
            *,
            value: Any = None,
            error: str | None = None,
            arguments: dict[str, Any] | None = None,
        ) -> ToolExecution:
            content = error_content(error) if error is not None else value_content(value)
            return ToolExecution(
                call_id=call.id,
                name=call.name,
                arguments=arguments,
                outcome=outcome,
                value=value,
                error=error,
                content=content,
                started_at=started,
                completed_at=self.clock(),
            )

        if ex.stop_signal is not None:
            # a hook stopped the turn after the model asked for tools: none of them runs
            stopped = f"not run: the turn was stopped by {ex.stop_signal.source}"
            return await self.after_tool(ctx, finish("blocked", error=stopped), ex), {}, None
        definition = offered.get(call.name)
        pending = ex.pending
        if definition is None and pending is not None and call.name in pending.offered:
            # Offered when the model was called, not announced now: an outage may hide a live
            # service, and the call may have run already. It is sent as it was (same
            # idempotency key): a live service answers, from its stored reply if it ran; a gone
            # one leaves it to time out, or the broker returns it at once when nothing is bound.
            definition = catalog.last_known(call.name) or ToolDefinition(name=call.name)
        if definition is None:
            rejected = finish("error", error=f"unknown tool: {call.name!r}")
            return await self.after_tool(ctx, rejected, ex), {}, None
        arguments = call_arguments(call, pending)
        if isinstance(arguments, Refused):
            rejected = finish(arguments.outcome, error=arguments.error, arguments=arguments.given)
            return await self.after_tool(ctx, rejected, ex), {}, None
        decision = await self.hooks.before_tool(ctx, ToolInvocation(call.id, call.name, arguments))
        if isinstance(decision, Blocked):
            blocked = finish("blocked", error=f"blocked: {decision.reason}", arguments=arguments)
            return await self.after_tool(ctx, blocked, ex), {}, None
        reply = await self._call(ctx, decision, definition, started)
        if isinstance(reply, _Failed):
            failed = finish("error", error=reply.error, arguments=arguments)
            return await self.after_tool(ctx, failed, ex), {}, reply.outcome
        if reply.status == "ok":
            execution = finish("ok", value=reply.value, arguments=arguments)
        elif reply.status == "unknown":
            message = reply.error or "the tool may or may not have run; it was not run again"
            execution = finish("unknown", error=f"outcome unknown: {message}", arguments=arguments)
        else:
            execution = finish("error", error=reply.error or "tool failed", arguments=arguments)
        updates = dict(reply.state_updates)
        if updates:
            execution = execution.model_copy(update={"state_keys": tuple(sorted(updates))[:64]})
        return await self.after_tool(ctx, execution, ex), updates, None

    async def _call(
        self, ctx: HookContext, call: ToolInvocation, definition: ToolDefinition, started: float
    ) -> ToolCallReply | _Failed:
        ex = turn_of(ctx.state)
        timeout = min(definition.timeout_s, ex.limits.tool_timeout_s)
        if ex.request.deadline is not None:  # no call outlives its turn
            timeout = max(0.001, min(timeout, ex.request.deadline - started))
        request = ToolCallRequest(
            call_id=call.call_id,
            tool=call.name,
            arguments=call.arguments,
            context=ToolContext(
                session_id=ctx.state.session_id,
                turn_id=ex.turn_id,
                agent=ex.request.agent,
                metadata=ex.request.metadata,
                deadline=started + timeout,
                idempotency_key=idempotency_key(ex.turn_id, call.call_id),
                state=shared_state(ctx.state, ex),
                tenant=tenancy.current(),
            ),
        )
        try:
            async with asyncio.timeout(timeout):
                return await self.caller.call(request, definition)
        except TimeoutError:
            return _Failed(f"tool {call.name!r} timed out after {timeout:g}s", "timeout")
        except ToolUnavailableError as exc:
            return _Failed(str(exc), "unavailable")
        except ToolCallError as exc:
            return _Failed(str(exc), "error")
        except RetryableError:
            # the transport lost the call (e.g. a broker reconnect ate the reply): redo the step;
            # the call is re-sent with the same idempotency key and answered from the store
            raise
        except Exception as exc:
            log.warning("tool %s failed for turn %s", call.name, ex.turn_id, exc_info=True)
            return _Failed(f"tool {call.name!r} failed: {type(exc).__name__}: {exc}", "error")

    async def after_tool(
        self, ctx: HookContext, execution: ToolExecution, ex: ExecutionState
    ) -> ToolExecution:
        """A result as the model gets it: through the ``after_tool`` hooks (redaction), then
        truncated to ``max_tool_result_chars``."""
        try:
            execution = await self.hooks.after_tool(ctx, execution)
        except RetryableError:
            raise  # e.g. the redaction table is out of reach: the step is redone, nothing is lost
        except Exception as exc:
            log.exception("after_tool hook failed for %s", execution.name)
            execution = execution.model_copy(
                update={
                    "outcome": "error",
                    "value": None,
                    "error": f"result withheld: {type(exc).__name__}",
                    "content": error_content("result withheld: a hook failed"),
                }
            )
        content, cut = truncate(execution.content, ex.limits.max_tool_result_chars)
        if cut:
            execution = execution.model_copy(update={"content": content, "truncated": True})
        return execution

    async def emit_invoked(self, state: AgentState, step: int, execution: ToolExecution) -> None:
        """``tool.invoked`` for a saved result (and ``state.updated`` when it set state)."""
        for kind, data in result_events(execution):
            await self.emit(
                kind, data, state, step=step, call_id=execution.call_id, at=execution.completed_at
            )


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _record(
    state: AgentState,
    execution: ToolExecution,
    updates: dict[str, Any],
    ctx: HookContext,
    now: float,
) -> AgentState:
    ex = turn_of(state)
    pending = ex.pending
    assert pending is not None
    pending = pending.model_copy(update={"results": (*pending.results, execution)})
    ex_changes: dict[str, Any] = {
        "pending": pending,
        "stop_signal": ex.stop_signal or ctx.stop_signal,
        "updated_at": now,
    }
    changes: dict[str, Any] = {}
    if updates and ex.request.persist:
        changes["context"] = state.context.model_copy(
            update={"kv": {**state.context.kv, **updates}}
        )
    elif updates:  # a turn that leaves the session as it was keeps its updates to itself
        ex_changes["state_updates"] = {**ex.state_updates, **updates}
    changes["execution"] = ex.model_copy(update=ex_changes)
    return state.model_copy(update=changes)
