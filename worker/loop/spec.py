"""What the loop needs to know of an agent: its prompt, model settings, tools and limits.

The loop takes an ``AgentSpec`` and a ``Hook``; where the spec comes from (an agents file, a
profile with hook sets and their configuration) is the worker's business (``worker.profiles.agents``).
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import Field, model_validator

from contracts.base import AgentName, Contract, SafeId
from contracts.turns import NO_BUDGET, Budget, LoopLimits
from worker.loop.context import NO_CONTEXT_BUDGET, ContextBudget
from worker.loop.workflow import Workflow


class SubAgent(Contract):
    """An agent another agent may call as a tool (``agents`` of its profile): each call runs as
    a child turn of that agent, in a session of its own (``session``: one named session for
    every call, queued there one after another), and its answer is the call's result."""

    agent: AgentName
    session: SafeId | None = Field(
        default=None,
        description="The child turns' session; default: one per call, derived from the "
        "caller's session and the call id.",
    )
    description: str | None = Field(
        default=None,
        max_length=8000,
        description="What the model is told of the tool; default: the agent's description.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"agent": value} if isinstance(value, str) else value


class ModelChoice(Contract):
    """One model of an agent's chain: a provider of the workers' configuration and its model."""

    provider: str = Field(default="default", min_length=1, max_length=64)
    model: str | None = Field(default=None, description="Default: the provider's model.")


class AgentSpec(Contract):
    name: AgentName
    description: str = Field(
        default="",
        max_length=8000,
        description="What the agent does: what a model calling it as a tool is told.",
    )
    system_prompt: str | None = None
    prompt_version: str | None = Field(
        default=None,
        max_length=64,
        description="The prompt's version, recorded with every turn; default: a short hash of "
        "the prompt.",
    )
    provider: str | None = Field(
        default=None, max_length=64, description="The workers' provider to call (default: default)."
    )
    model: str | None = Field(default=None, description="Overrides the provider's default model.")
    models: tuple[ModelChoice, ...] = Field(
        default=(),
        max_length=8,
        description="A fallback chain instead of provider and model: on a model error the "
        "provider's retries did not fix, the step tries the next.",
    )
    temperature: float | None = Field(default=None, ge=0, le=2)
    max_tokens: int | None = Field(default=None, ge=1)
    tools: tuple[str, ...] = Field(
        default=("*",), description="Tool names the agent may use; '*' allows every announced tool."
    )
    limits: LoopLimits = LoopLimits()
    approval: tuple[str, ...] = Field(
        default=(),
        description="Tools whose calls wait for a human's decision ('*': every tool); the turn "
        "parks meanwhile, holding no worker.",
    )
    approval_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        le=30 * 24 * 3600,
        description="A call undecided this long is rejected.",
    )
    children_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        le=7 * 24 * 3600,
        description="A child turn (a sub-agent call, a workflow node) that has not answered "
        "this long ends as an error for the caller, and is cancelled.",
    )

    budget: Budget = Field(default=NO_BUDGET, description="What one turn may spend.")
    session_budget: Budget = Field(
        default=NO_BUDGET, description="What a session's turns may spend, together."
    )
    daily_budget: Budget = Field(
        default=NO_BUDGET,
        description="What the agent's turns may spend in a day (UTC), across every session.",
    )
    budget_note: str = Field(
        default=(
            "Your budget for this request is spent: answer now with what you have, saying "
            "what you could not finish."
        ),
        max_length=2000,
        description="Sent with the last model call once a budget is spent (no tools offered).",
    )

    output_schema: dict[str, Any] | None = Field(
        default=None,
        description="JSON Schema the final answer must match (TurnResult.output carries it).",
    )
    max_output_repairs: int = Field(
        default=2, ge=0, le=10, description="Invalid answers sent back to the model to repair."
    )

    stream: bool = Field(
        default=False,
        description="Stream the model's text as message.delta events (a turn request may say "
        "otherwise).",
    )

    agents: tuple[SubAgent, ...] = Field(
        default=(),
        max_length=64,
        description="Agents (or workflows) this agent may call as tools; each call is a child "
        "turn.",
    )
    max_depth: int = Field(
        default=3,
        ge=1,
        le=32,
        description="How deep a tree of child turns under this agent's turns may grow.",
    )
    context: ContextBudget = Field(
        default=NO_CONTEXT_BUDGET, description="How much of the conversation a request may send."
    )
    workflow: Workflow | None = Field(
        default=None, description="Set for a workflow: it runs its nodes instead of a model."
    )

    @model_validator(mode="after")
    def _versioned(self) -> AgentSpec:
        if self.models and (self.provider is not None or self.model is not None):
            raise ValueError("give 'models' (a chain) or 'provider' and 'model', not both")
        if self.prompt_version is None:  # set in place: the validator returns the model itself
            digest = hashlib.sha256((self.system_prompt or "").encode()).hexdigest()[:12]
            self.__dict__["prompt_version"] = digest
        return self

    @property
    def route(self) -> tuple[ModelChoice, ...]:
        """The models a step asks, in order."""
        return self.models or (ModelChoice(provider=self.provider or "default", model=self.model),)

    def sub_agent(self, name: str) -> SubAgent | None:
        return next((a for a in self.agents if a.agent == name), None)

    def allows(self, tool: str) -> bool:
        return "*" in self.tools or tool in self.tools

    def needs_approval(self, tool: str) -> bool:
        return "*" in self.approval or tool in self.approval
