"""Agent state kept in Redis between steps.

``AgentState`` is the session layer; ``ExecutionState`` is the turn in progress
(``None`` between turns). The session's message history is kept beside the
state as an append-only list (see ``worker.session.store``), so that appending one
message never rewrites the others; ``AgentState.history_len`` counts it.

A step is saved in phases so that a redelivered work message resumes where the
last worker stopped: ``PendingStep.response`` is the saved model answer (never
asked for again) and ``PendingStep.results`` the saved tool results (never
dispatched again); a call without a saved result is re-sent with the same
idempotency key.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import Field, model_validator

from contracts.base import AgentName, Contract, JsonObject, SafeId
from contracts.control import TurnDecision
from contracts.messages import Usage
from contracts.steps import AgentStep as AgentStep
from contracts.steps import ContextUse as ContextUse
from contracts.steps import ModelResponse as ModelResponse
from contracts.steps import ModelRun as ModelRun
from contracts.steps import StepExecution as StepExecution
from contracts.steps import StepType as StepType
from contracts.steps import ToolExecution as ToolExecution
from contracts.steps import ToolOutcome as ToolOutcome
from contracts.steps import counted_model as counted_model
from contracts.turns import LoopLimits, TurnRequest, TurnResult

ExecutionStatus = Literal[
    "pending", "in_progress", "waiting", "completed", "stopped", "failed", "cancelled"
]


class PendingStep(ContextUse):
    """The step in progress, saved between its phases."""

    index: int = Field(ge=0)
    started_at: float
    input_count: int = 0
    response: ModelResponse | None = None
    results: tuple[ToolExecution, ...] = ()
    offered: tuple[str, ...] = Field(
        default=(), description="Names of the tools the model was offered in this step."
    )
    dispatches: int = Field(
        default=1,
        ge=1,
        description="Rounds of sending the step's tool calls: 1 by the worker that saved the "
        "model's answer, one more each time the tool phase is redone.",
    )
    dispatched_at: float = Field(default=0.0, description="When the latest round went out.")
    decisions: dict[str, TurnDecision] = Field(
        default_factory=dict,
        description="Decisions on the calls that needed approval, by call id (a timeout is a "
        "rejection by 'timeout').",
    )

    def result_for(self, call_id: str) -> ToolExecution | None:
        return next((r for r in self.results if r.call_id == call_id), None)


class StopSignal(Contract):
    """A hook asked the loop to stop."""

    source: str = Field(max_length=128)
    reason: str = Field(default="", max_length=2000)


class ChildTurn(Contract):
    """A child turn a parked turn waits for: the call that started it, its turn and session."""

    call_id: str
    turn_id: SafeId
    session_id: SafeId
    agent: AgentName


class Wait(Contract):
    """What a parked turn waits for. ``approval``: decisions on ``call_ids``; ``throttled``:
    its slot under the model's rate limits, at ``until``; ``children``: the results of the
    child turns it started (``children``), one for each call of ``call_ids``."""

    kind: Literal["approval", "throttled", "children"]
    call_ids: tuple[str, ...] = ()
    since: float
    until: float | None = Field(default=None, description="When the wait times out.")
    children: tuple[ChildTurn, ...] = Field(
        default=(),
        exclude_if=lambda value: not value,  # added to v1: written only when set
    )
    answered: int = Field(
        default=0,
        ge=0,
        description="Children whose results the parked turn has saved.",
        exclude_if=lambda value: value == 0,
    )


class TurnTrace(Contract):
    """The ids of a turn's ``invoke_agent`` span, chosen when the turn starts (its steps are
    its children) and given to the span when the turn ends, maybe on another worker."""

    trace_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    span_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    sampled: bool = True
    started_at: float = Field(description="The span's start: the turn's.")


class ExecutionState(Contract):
    """The turn in progress.

    What a completed step produced is written once, when the step completes, to the turn's
    step list (``keys.turn_steps``, ``StepExecution.stored``) beside the history, and never
    rewritten: the state keeps only what the next step needs (``step_count``, ``tool_calls``,
    ``models``, the pending step, waits, usage, the last content, the streak), so a save late
    in a long turn writes what one early in it does. ``steps`` holds the steps that a worker of
    an earlier release completed, which kept every record here; it never grows."""

    turn_id: SafeId
    request: TurnRequest
    limits: LoopLimits
    prompt_version: str | None = Field(
        default=None,
        description="The agent's prompt version when the turn started.",
        exclude_if=lambda value: value is None,
    )
    status: ExecutionStatus = "pending"
    history_start: int = Field(
        default=0, ge=0, description="Session history length before the turn."
    )
    message_count: int = Field(default=0, ge=0, description="Messages this turn added so far.")
    steps: tuple[StepExecution, ...] = Field(
        default=(),
        description="Steps completed before the upgrade to step lists, as an earlier release "
        "kept them (never written by this one); later steps' records are in the turn's step "
        "list.",
        exclude_if=lambda value: not value,
    )
    step_count: int = Field(
        default=0,
        ge=0,
        description="Steps the turn completed (the next step's index).",
        exclude_if=lambda value: value == 0,  # added to v1: written only when set
    )
    tool_calls: int = Field(
        default=0,
        ge=0,
        description="Tool calls recorded by the completed steps.",
        exclude_if=lambda value: value == 0,
    )
    continued_by: tuple[str, ...] = Field(
        default=(),
        description="The hooks that asked the turn to go on after a step so far, each once "
        "(``AgentStep.continued_by``).",
        exclude_if=lambda value: not value,
    )
    models: tuple[ModelRun, ...] = Field(
        default=(),
        description="The models that answered the completed steps, in order, run by run.",
        exclude_if=lambda value: not value,
    )
    pending: PendingStep | None = None
    stop_signal: StopSignal | None = None
    wait: Wait | None = Field(default=None, description="Set while the turn is parked.")
    usage: Usage = Usage()
    cost_usd: float = Field(default=0.0, ge=0)
    children_tokens: int = Field(
        default=0,
        ge=0,
        description="The tokens of ``usage`` its child turns spent (their agents' days count "
        "them, not this agent's).",
        exclude_if=lambda value: not value,  # added to v1: written only when set
    )
    children_cost_usd: float = Field(
        default=0.0,
        ge=0,
        description="The cost of ``cost_usd`` its child turns spent.",
        exclude_if=lambda value: not value,
    )
    output_repairs: int = Field(
        default=0, ge=0, description="Invalid structured answers sent back to the model so far."
    )
    context_forced: bool = Field(
        default=False,
        description="The model said the last request was too long: the step is sent again "
        "with half of it.",
        exclude_if=lambda value: not value,
    )
    budget_spent: str | None = Field(
        default=None,
        description="The budget found spent ('turn.max_total_tokens' …): the turn's last model "
        "call is made without tools, then it ends.",
    )
    empty_streak: int = 0
    last_content: str | None = None
    state_updates: JsonObject = Field(
        default_factory=dict,
        description="State updates of a persist: false turn's tools: kept with the turn, never "
        "merged into the session's key-value state.",
    )
    started_at: float
    updated_at: float
    result: TurnResult | None = None
    trace: TurnTrace | None = Field(
        default=None,
        description="Set when the worker that started the turn traces (OpenTelemetry).",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )

    @model_validator(mode="before")
    @classmethod
    def _counted_from_steps(cls, data: Any) -> Any:
        """A state an earlier release wrote keeps its completed steps inline and no counters:
        the counters are taken from them (the records stay where they are)."""
        if not isinstance(data, dict) or not data.get("steps") or "step_count" in data:
            return data
        records = [
            s if isinstance(s, StepExecution) else StepExecution.model_validate(s)
            for s in data["steps"]
        ]
        runs: list[ModelRun] = []
        for record in records:
            runs = counted_model(runs, record)
        continued = [r.step.continued_by for r in records if r.step.continued_by]
        return {
            **data,
            "steps": tuple(records),
            "continued_by": tuple(dict.fromkeys(continued)),
            "step_count": len(records),
            "tool_calls": sum(len(r.step.tool_executions) for r in records),
            "models": tuple(runs),
        }


class Spend(Contract):
    """What turns spent, summed: the session's finished turns, or an agent's in a day."""

    total_tokens: int = Field(default=0, ge=0)
    cost_usd: float = Field(default=0.0, ge=0)
    tool_calls: int = Field(default=0, ge=0)
    wall_s: float = Field(default=0.0, ge=0)

    def __add__(self, other: Spend) -> Spend:
        return Spend(
            total_tokens=self.total_tokens + other.total_tokens,
            cost_usd=self.cost_usd + other.cost_usd,
            tool_calls=self.tool_calls + other.tool_calls,
            wall_s=self.wall_s + other.wall_s,
        )


NO_SPEND: Final = Spend()


class ContextSummary(Contract):
    """What the session's oldest messages said, as one model call summarized them: it stands
    for the history's messages before ``upto`` in what is sent."""

    text: str = Field(max_length=100_000)
    upto: int = Field(ge=0)
    made_at: float


class SessionContext(Contract):
    """What the session carries besides its messages."""

    system_prompt: str | None = Field(
        default=None,
        description="Not read: every model call uses the turn's agent's prompt as its profile "
        "says now (earlier releases copied the first agent's prompt here).",
    )
    metadata: JsonObject = Field(default_factory=dict)
    response_format: JsonObject | None = None
    kv: JsonObject = Field(default_factory=dict, description="Key-value state tools may update.")


class LLMOverrides(Contract):
    """Per-session overrides of the agent's model settings."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    max_tokens: int | None = Field(default=None, ge=1)


class EndedStep(Contract):
    """The last step of the session's last turn, kept until its next turn starts: what its
    events are rebuilt from when the end is announced again (the same events, byte for byte)."""

    turn_id: SafeId
    record: StepExecution
    invoked: tuple[ToolExecution, ...] = Field(
        default=(), description="The results the turn's last save stored (announced with it)."
    )


class AgentState(Contract):
    """The session: its context, counters and the turn in progress. Versioned for compare-and-set."""

    schema_version: Literal[1] = 1
    session_id: SafeId
    parent_session_id: SafeId | None = None
    agent: AgentName
    context: SessionContext = SessionContext()
    llm: LLMOverrides = LLMOverrides()
    history_len: int = Field(default=0, ge=0)
    execution_count: int = Field(default=0, ge=0)
    spent: Spend = Field(default=NO_SPEND, description="What the session's turns spent.")
    summary: ContextSummary | None = Field(
        default=None,
        description="With a summarize context budget: the summary sent for the oldest messages.",
        exclude_if=lambda value: value is None,
    )
    token_ratio: float | None = Field(
        default=None,
        gt=0,
        description="The last model answer's prompt_tokens over the estimate of what it was sent.",
        exclude_if=lambda value: value is None,
    )
    ended_step: EndedStep | None = Field(
        default=None,
        description="Between turns: the last turn's last step, for announcing its end again.",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )
    version: int = Field(default=0, ge=0)
    created_at: float
    updated_at: float
    execution: ExecutionState | None = None
