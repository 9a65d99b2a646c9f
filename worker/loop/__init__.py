"""The agent loop: pure logic over small interfaces (model, tools, store, events, hooks)."""

from worker.loop.engine import Finished, Loop, RunAgain, StepOutcome
from worker.loop.hooks import Blocked, Hook, HookContext, Hooks, ToolInvocation
from worker.loop.ports import (
    EventSink,
    Model,
    ModelRequest,
    StateStore,
    ToolCaller,
    ToolCatalog,
)
from worker.loop.records import new_execution

__all__ = [
    "Blocked",
    "EventSink",
    "Finished",
    "Hook",
    "HookContext",
    "Hooks",
    "Loop",
    "Model",
    "ModelRequest",
    "RunAgain",
    "StateStore",
    "StepOutcome",
    "ToolCaller",
    "ToolCatalog",
    "ToolInvocation",
    "new_execution",
]
