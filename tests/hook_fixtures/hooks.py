"""Hook sets for tests, enabled as ``tests.hook_fixtures.hooks:<Class>`` in an agents file."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from contracts.messages import ChatMessage
from contracts.state import AgentStep, ModelResponse, ToolExecution
from worker.loop.hooks import Blocked, Hook, HookContext, ToolInvocation


class StopAt(Hook):
    """Stops the turn at one hook point of one step."""

    name = "stop_at"

    class Config(BaseModel):
        point: Literal[
            "before_execution",
            "before_step",
            "prepare_messages",
            "after_model",
            "before_tool",
            "after_tool",
            "after_step",
        ]
        step: int = 0
        reason: str = "stopped by the test's hook"

    def __init__(self, config: Config) -> None:
        self.config = config

    def _maybe_stop(self, point: str, ctx: HookContext) -> None:
        if point == self.config.point and ctx.step == self.config.step:
            ctx.stop(self.name, self.config.reason)

    async def before_execution(self, ctx: HookContext) -> None:
        self._maybe_stop("before_execution", ctx)

    async def before_step(self, ctx: HookContext) -> None:
        self._maybe_stop("before_step", ctx)

    async def prepare_messages(
        self, ctx: HookContext, messages: list[ChatMessage]
    ) -> list[ChatMessage]:
        self._maybe_stop("prepare_messages", ctx)
        return messages

    async def after_model(self, ctx: HookContext, response: ModelResponse) -> ModelResponse:
        self._maybe_stop("after_model", ctx)
        return response

    async def before_tool(self, ctx: HookContext, call: ToolInvocation) -> ToolInvocation | Blocked:
        self._maybe_stop("before_tool", ctx)
        return call

    async def after_tool(self, ctx: HookContext, execution: ToolExecution) -> ToolExecution:
        self._maybe_stop("after_tool", ctx)
        return execution

    async def after_step(self, ctx: HookContext, step: AgentStep) -> None:
        self._maybe_stop("after_step", ctx)


class FailingAfterTool(Hook):
    """An ``after_tool`` hook with a bug: it raises on every result."""

    name = "failing_after_tool"

    async def after_tool(self, ctx: HookContext, execution: ToolExecution) -> ToolExecution:
        raise RuntimeError("the hook has a bug")


NOT_A_HOOK = object()
