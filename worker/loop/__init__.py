"""The agent loop: pure logic over small interfaces (model, tools, store, events, hooks)."""

from worker.loop.engine import Loop
from worker.loop.hooks import Blocked, Hook, HookContext, Hooks, ToolInvocation
from worker.loop.outcomes import Finished, RunAgain, StepOutcome, Waiting
from worker.loop.ports import (
    EventSink,
    Model,
    ModelRequest,
    Parked,
    StateStore,
    ToolCaller,
    ToolCatalog,
)
from worker.loop.spec import AgentSpec
from worker.loop.turn import new_execution

__all__ = [
    "AgentSpec",
    "Blocked",
    "EventSink",
    "Finished",
    "Hook",
    "HookContext",
    "Hooks",
    "Loop",
    "Model",
    "ModelRequest",
    "Parked",
    "RunAgain",
    "StateStore",
    "StepOutcome",
    "ToolCaller",
    "ToolCatalog",
    "ToolInvocation",
    "Waiting",
    "new_execution",
]
