"""What a step of a turn produced, as recorded: the model's answer, each tool call and its
outcome, the step itself with its timing, and the runs of models that answered. A completed
step's record is written once to its turn's step list (``contracts.keys.turn_steps``) in its
stored form (``StepExecution.stored``); ``contracts.state`` holds the turn in progress."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field

from contracts.base import CallId, Contract, JsonObject
from contracts.messages import ChatMessage, Usage

ToolOutcome = Literal["ok", "error", "blocked", "unknown"]
StepType = Literal["final_response", "tool_execution", "error"]


class ModelResponse(Contract):
    """What the model answered, as saved before any tool is dispatched."""

    message: ChatMessage
    finish_reason: str = "stop"
    usage: Usage = Usage()
    model: str = ""
    response_id: str | None = None
    duration_s: float = 0.0
    provider: str | None = Field(
        default=None,
        description="The provider that answered, when not 'default'.",
        exclude_if=lambda value: value is None,
    )
    cost_usd: float = Field(
        default=0.0,
        ge=0,
        description="What this call cost, from the workers' price table at the time.",
        exclude_if=lambda cost: cost == 0.0,  # added to v1: written only when set
    )


class ToolExecution(Contract):
    """One tool call of a step and its outcome.

    ``content`` is the text the model received (truncated, with any hint). In a
    completed step, ``value`` is dropped when ``truncated`` is set, so that a huge
    result does not stay in the state for the rest of the turn."""

    call_id: CallId
    name: str
    arguments: JsonObject | None = None
    outcome: ToolOutcome
    value: Any = None
    error: str | None = None
    content: str = Field(description="The text the model receives for this call.")
    truncated: bool = False
    unresolved_placeholders: tuple[str, ...] = Field(
        default=(),
        max_length=32,
        description="Placeholder-like tokens in the arguments that a redaction hook could not "
        "restore and passed to the tool as written (never a raw value).",
    )
    state_keys: tuple[str, ...] = Field(
        default=(),
        description="The keys of the session's key-value state the call's state_updates set.",
        exclude_if=lambda value: not value,
    )
    started_at: float
    completed_at: float

    @property
    def duration_s(self) -> float:
        return max(0.0, self.completed_at - self.started_at)


class ContextUse(Contract):
    """What a step sent the model, when its agent has a context budget."""

    sent_tokens: int | None = Field(
        default=None,
        description="The estimated tokens the model was sent (with a context budget).",
        exclude_if=lambda value: value is None,
    )
    summarized: bool = Field(
        default=False,
        description="Whether a summary was sent in place of older messages.",
        exclude_if=lambda value: not value,
    )


class AgentStep(ContextUse):
    """One step: what the model saw and said, and the tools it ran."""

    index: int = Field(ge=0)
    input_count: int = Field(ge=0, description="Messages the model saw, system prompt included.")
    output_messages: tuple[ChatMessage, ...] = ()
    response: ModelResponse | None = None
    tool_executions: tuple[ToolExecution, ...] = ()
    errors: tuple[str, ...] = ()
    stopped_by: str | None = Field(
        default=None,
        description="The stop signal of the step (a hook's source), overridden when "
        "continued_by is set too.",
        exclude_if=lambda value: value is None,
    )
    continued_by: str | None = Field(
        default=None,
        description="The hook that asked the turn to go on after this step.",
        exclude_if=lambda value: value is None,
    )

    @property
    def type(self) -> StepType:
        if self.errors or self.response is None:
            return "error"
        return "tool_execution" if self.tool_executions else "final_response"


class StepExecution(Contract):
    """A completed step with its timing."""

    step: AgentStep
    started_at: float
    completed_at: float

    @property
    def duration_s(self) -> float:
        return max(0.0, self.completed_at - self.started_at)

    def stored(self) -> StepExecution:
        """The record as the turn's step list keeps it (``keys.turn_steps``): without what the
        history holds already. Its output messages are the history's; a call whose result went
        to the history as a tool message keeps its metadata (outcome, error, timing, arguments)
        but not its text or value, which that message carries. A call whose result is not in
        the history (a workflow node's answer) keeps them, its value only when it is not the
        text itself."""
        step = self.step
        answered = {m.tool_call_id for m in step.output_messages if m.role == "tool"}
        executions = tuple(
            e.model_copy(update={"content": "", "value": None})
            if e.call_id in answered
            else e.model_copy(update={"value": None})
            if isinstance(e.value, str)
            else e
            for e in step.tool_executions
        )
        bare = step.model_copy(update={"output_messages": (), "tool_executions": executions})
        return self.model_copy(update={"step": bare})


class ModelRun(Contract):
    """Consecutive completed steps answered by one model (``TurnResult.models``, kept short)."""

    model: str
    steps: int = Field(default=1, ge=1)


def counted_model(runs: Sequence[ModelRun], record: StepExecution) -> list[ModelRun]:
    """``runs`` with the model that answered ``record``'s step (none: a workflow's step)."""
    response = record.step.response
    model = response.model if response is not None else ""
    out = list(runs)
    if not model:
        return out
    if out and out[-1].model == model:
        out[-1] = ModelRun(model=model, steps=out[-1].steps + 1)
    else:
        out.append(ModelRun(model=model))
    return out
