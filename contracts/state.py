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

from pydantic import Field

from contracts.base import AgentName, CallId, Contract, JsonObject, SafeId
from contracts.control import TurnDecision
from contracts.messages import ChatMessage, Usage
from contracts.turns import LoopLimits, TurnRequest, TurnResult

ExecutionStatus = Literal[
    "pending", "in_progress", "waiting", "completed", "stopped", "failed", "cancelled"
]
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
    """The turn in progress."""

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
    steps: tuple[StepExecution, ...] = ()
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
