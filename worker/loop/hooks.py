"""Hooks: one protocol with nine points, configured per agent.

Every method has a no-op default; a hook overrides only what it needs. Any
hook can call ``ctx.stop(source, reason)`` and the turn ends with ``stopped_by``
set to ``source``, unless an ``after_step`` hook of the same step calls
``ctx.continue_turn(source, message)``, which overrides it (a spent budget is not
overridden); after a final answer ``continue_turn`` asks for one more step, with
``message`` for the model (a self-check), within the iteration cap. The step's record says
which hook stopped or continued it (``AgentStep.stopped_by``, ``continued_by``). A stop
takes effect: a stop before the model is called (``before_execution``,
``before_step``, ``prepare_messages``) ends it without calling the model; a stop
in ``after_model`` records the step's tool calls as blocked; a later stop
(``before_tool``, ``after_tool``, ``after_step``) lets the step's tools finish.
A hook that raises fails the step, which is retried and then dead-lettered,
except in ``after_tool`` (the model gets ``{"error": "result withheld: a hook
failed"}``: the real result is never shown unchecked) and ``after_execution``
(logged; the turn's ending stands).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from contracts.messages import ChatMessage
from contracts.state import AgentState, AgentStep, ModelResponse, StopSignal, ToolExecution
from contracts.turns import TurnResult
from worker.loop.spec import AgentSpec


@dataclass(frozen=True, slots=True)
class ToolInvocation:
    """A tool call about to run: its id, tool name and parsed arguments."""

    call_id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Blocked:
    """Returned by ``before_tool`` to refuse a call; the model gets ``{"error": reason}``."""

    reason: str


@dataclass(slots=True)
class HookContext:
    """What a hook may look at, and its way to stop the turn. The state is read-only: its
    contracts are frozen, and a change made in place to one of its dicts (``context.kv``,
    metadata) is not kept."""

    state: AgentState
    agent: AgentSpec
    step: int
    stop_signal: StopSignal | None = field(default=None)
    continuation: Continuation | None = field(default=None)

    def stop(self, source: str, reason: str = "") -> None:
        if self.stop_signal is None:
            self.stop_signal = StopSignal(source=source, reason=reason)

    def continue_turn(self, source: str, message: str | None = None) -> None:
        """From ``after_step``: the turn goes on. It overrides a stop signal of the same step
        (not a spent budget); after a final answer it asks for one more step, ``message``
        (if any) going to the model first — a self-check — within the iteration cap."""
        if self.continuation is None:
            self.continuation = Continuation(source=source[:128], message=message)


@dataclass(frozen=True, slots=True)
class Continuation:
    """A hook asked the turn to go on (``HookContext.continue_turn``)."""

    source: str
    message: str | None = None


class Hook:
    """Base hook: override any of the nine points."""

    name = "hook"
    changes_answer = True
    """Whether ``after_model``, where this hook overrides it, may change the answer: a streamed
    answer is then held back until it ran (``worker.loop.streaming``). A hook whose
    ``after_model`` only reads the answer says ``False`` and keeps the live stream."""

    async def before_execution(self, ctx: HookContext) -> None:
        """The turn is about to start (once per turn)."""

    async def after_execution(self, ctx: HookContext, result: TurnResult) -> None:
        """The turn has finished with ``result`` (once per turn)."""

    async def before_step(self, ctx: HookContext) -> None:
        """A step is about to call the model."""

    async def after_step(self, ctx: HookContext, step: AgentStep) -> None:
        """A step has completed."""

    async def prepare_messages(
        self, ctx: HookContext, messages: list[ChatMessage]
    ) -> list[ChatMessage]:
        """Rewrite what the model will see (redaction). A step redone after a crash runs it
        again on the same messages: give the same answer for the same input."""
        return messages

    async def after_model(self, ctx: HookContext, response: ModelResponse) -> ModelResponse:
        """The model answered; rewrite or inspect the answer before it is saved."""
        return response

    async def before_tool(self, ctx: HookContext, call: ToolInvocation) -> ToolInvocation | Blocked:
        """A tool is about to run: restore values, rewrite arguments, or block the call."""
        return call

    async def after_tool(self, ctx: HookContext, execution: ToolExecution) -> ToolExecution:
        """A tool returned: rewrite its result before the model sees it (redaction)."""
        return execution

    async def needs_approval(self, ctx: HookContext, call: ToolInvocation) -> bool:
        """Whether this call waits for a human's decision, besides the tools the profile lists
        under ``approval`` (a refund over some amount, say). Asked once, before the step's
        tools run; the turn parks until the call is decided. Judge the call only: no I/O."""
        return False


class Hooks(Hook):
    """Several hooks run in order, as one."""

    name = "hooks"

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        self.hooks = tuple(hooks)

    async def before_execution(self, ctx: HookContext) -> None:
        for hook in self.hooks:
            await hook.before_execution(ctx)

    async def after_execution(self, ctx: HookContext, result: TurnResult) -> None:
        for hook in self.hooks:
            await hook.after_execution(ctx, result)

    async def before_step(self, ctx: HookContext) -> None:
        for hook in self.hooks:
            await hook.before_step(ctx)

    async def after_step(self, ctx: HookContext, step: AgentStep) -> None:
        for hook in self.hooks:
            await hook.after_step(ctx, step)

    async def prepare_messages(
        self, ctx: HookContext, messages: list[ChatMessage]
    ) -> list[ChatMessage]:
        for hook in self.hooks:
            messages = await hook.prepare_messages(ctx, messages)
        return messages

    async def after_model(self, ctx: HookContext, response: ModelResponse) -> ModelResponse:
        for hook in self.hooks:
            response = await hook.after_model(ctx, response)
        return response

    async def before_tool(self, ctx: HookContext, call: ToolInvocation) -> ToolInvocation | Blocked:
        for hook in self.hooks:
            decision = await hook.before_tool(ctx, call)
            if isinstance(decision, Blocked):
                return decision
            call = decision
        return call

    async def after_tool(self, ctx: HookContext, execution: ToolExecution) -> ToolExecution:
        for hook in self.hooks:
            execution = await hook.after_tool(ctx, execution)
        return execution

    async def needs_approval(self, ctx: HookContext, call: ToolInvocation) -> bool:
        for hook in self.hooks:
            if await hook.needs_approval(ctx, call):
                return True
        return False


def rewrites_messages(hook: Hook) -> bool:
    """Whether ``prepare_messages`` of ``hook`` does anything (the base hook's returns its input):
    if not, the loop need not build message objects for it."""
    if isinstance(hook, Hooks):
        return any(rewrites_messages(h) for h in hook.hooks)
    return type(hook).prepare_messages is not Hook.prepare_messages


def rewrites_answer(hook: Hook) -> bool:
    """Whether ``after_model`` of ``hook`` may change the answer (``Hook.changes_answer``)."""
    if isinstance(hook, Hooks):
        return any(rewrites_answer(h) for h in hook.hooks)
    return type(hook).after_model is not Hook.after_model and hook.changes_answer


def asks_approval(hook: Hook) -> bool:
    """Whether ``needs_approval`` of ``hook`` can say yes (the base hook's never does)."""
    if isinstance(hook, Hooks):
        return any(asks_approval(h) for h in hook.hooks)
    return type(hook).needs_approval is not Hook.needs_approval
