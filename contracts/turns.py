"""Turn requests (what publishers send) and turn results (what they get back)."""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import Field, field_validator, model_validator

from contracts.base import AgentName, Contract, JsonObject, SafeId
from contracts.messages import ChatMessage, Usage

FinishReason = Literal["stop", "length", "max_iterations", "error", "cancelled", "budget"]


class Budget(Contract):
    """What a turn (or a session, or an agent in a day) may spend; unset: no limit."""

    max_total_tokens: int | None = Field(default=None, ge=1)
    max_cost_usd: float | None = Field(
        default=None, gt=0, description="From the workers' price table (input and output)."
    )
    max_tool_calls: int | None = Field(default=None, ge=0)
    max_wall_s: float | None = Field(default=None, gt=0)

    def lowered(self, other: Budget) -> Budget:
        """Each limit of ``other`` where it is lower than this one's (never higher)."""
        if other.empty:
            return self
        if self.empty:
            return other
        merged: dict[str, float | int | None] = {}
        for name in type(self).model_fields:
            mine, theirs = getattr(self, name), getattr(other, name)
            merged[name] = theirs if mine is None else mine if theirs is None else min(mine, theirs)
        return Budget.model_validate(merged)

    @property
    def empty(self) -> bool:
        return self is NO_BUDGET or all(
            getattr(self, name) is None for name in type(self).model_fields
        )


NO_BUDGET: Final = Budget()
"""The default budget (no limit), one shared instance: a check for it is an identity test."""


class LoopLimits(Contract):
    """The loop's limits. Agent profiles set them; a turn request may override them within bounds."""

    max_tool_iterations: int = Field(default=7, ge=1, le=500)
    max_tool_result_chars: int = Field(default=16_000, ge=256, le=1_000_000)
    empty_streak_after: int = Field(default=2, ge=0, le=50)
    empty_streak_hint: str = Field(
        default=(
            "Your last :count searches found nothing. Stop searching and answer with what you "
            "have, saying what you could not find."
        ),
        max_length=2000,
    )
    result_keys: tuple[str, ...] = Field(
        default=("items", "results", "matches", "passages", "data"), max_length=32
    )
    tool_timeout_s: float = Field(default=30.0, gt=0, le=3600)


class LimitOverrides(Contract):
    """Per-turn overrides of the agent's loop limits; unset fields keep the agent's values."""

    max_tool_iterations: int | None = Field(default=None, ge=1, le=500)
    max_tool_result_chars: int | None = Field(default=None, ge=256, le=1_000_000)
    empty_streak_after: int | None = Field(default=None, ge=0, le=50)

    def apply(self, limits: LoopLimits) -> LoopLimits:
        changes = self.model_dump(exclude_none=True)
        return limits.model_copy(update=changes) if changes else limits


class InputMessage(Contract):
    """A message the publisher adds to the conversation for this turn."""

    role: Literal["user"] = "user"
    content: str = Field(max_length=1_000_000)

    def to_chat(self) -> ChatMessage:
        return ChatMessage(role=self.role, content=self.content)


class TurnParent(Contract):
    """The turn that started a child turn (a sub-agent call, a workflow node): its session,
    turn and call, the root of the tree and the child's depth in it (the root's children are
    at depth 1)."""

    session_id: SafeId
    turn_id: SafeId
    call_id: str = Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")
    root_turn_id: SafeId
    depth: int = Field(default=1, ge=1, le=32)


class TurnRequest(Contract):
    """Start a turn: the publisher names the agent and session and chooses the turn id.

    The turn id makes a publish idempotent: the same request delivered twice runs
    once and the duplicate is answered with the stored result.
    """

    schema_version: Literal[1] = 1
    turn_id: SafeId
    session_id: SafeId
    agent: AgentName
    input: tuple[InputMessage, ...] = Field(min_length=1, max_length=64)
    limits: LimitOverrides = LimitOverrides()
    persist: bool = True
    parent_session_id: SafeId | None = None
    metadata: JsonObject = Field(default_factory=dict)
    reply_to: str | None = Field(
        default=None,
        max_length=255,
        pattern=r"^[A-Za-z0-9_.:-]+$",
        description="Queue for the TurnResult (default exchange); not one of loopwire's own queues.",
    )
    deadline: float | None = Field(
        default=None, description="Unix time after which the turn is cancelled."
    )
    output_schema: JsonObject | None = Field(
        default=None,
        description="JSON Schema the answer must match, when the agent sets none.",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )
    budget: Budget = Field(
        default=NO_BUDGET,
        description="Lowers the agent's per-turn budget (never raises it).",
        exclude_if=lambda budget: budget.empty,  # added to v1: written only when set
    )
    parent: TurnParent | None = Field(
        default=None,
        description="Set on a child turn: its result goes to the parent as turn.child_result.",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )
    stream: bool | None = Field(
        default=None,
        description="Stream the model's text as message.delta events (true), or not (false), "
        "whatever the agent's profile says; None: as the profile says.",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )
    traceparent: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$",
        description="W3C trace context: the turn's span is a child of this one. Taken from the "
        "message's traceparent header when it has a valid one (publishers set the header).",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )
    tracestate: str | None = Field(
        default=None,
        max_length=512,
        description="W3C tracestate, carried with traceparent (from the header of that name).",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )

    @field_validator("reply_to")
    @classmethod
    def _not_our_queue(cls, value: str | None) -> str | None:
        if value is not None and value.startswith("loopwire."):
            raise ValueError("reply_to may not be one of loopwire's own queues")
        return value


class TurnError(Contract):
    """Why a turn failed: a stable machine-readable code and a human-readable message."""

    code: str = Field(max_length=64)
    message: str = Field(max_length=4000)


class TurnResult(Contract):
    """The outcome of a turn; stored under its turn id and published as turn.completed/failed.

    ``finish_reason`` is ``stop`` for an answer, ``max_iterations`` when the
    iteration cap ended the turn (``content`` is then the last content the model
    gave, not an answer), ``error`` with ``error`` set, ``cancelled``, or ``budget`` (a
    budget was spent: ``content`` is the answer the model gave without tools, told to answer
    with what it had). ``stopped_by`` names the hook, the cancel's reason, ``deadline`` or the
    budget (``turn.max_tool_calls``, ``session.max_cost_usd``, ``agent_day.…``) that ended it.
    """

    schema_version: Literal[1] = 1
    turn_id: SafeId
    session_id: SafeId
    agent: AgentName
    content: str | None
    finish_reason: FinishReason
    error: TurnError | None = None
    stopped_by: str | None = None
    usage: Usage = Usage()
    cost_usd: float = Field(
        default=0.0,
        ge=0,
        description="From the workers' price table.",
        exclude_if=lambda cost: cost == 0.0,  # added to v1: written only when set
    )
    steps: int = Field(ge=0)
    duration_s: float = Field(ge=0)
    completed_at: float
    output: Any = Field(
        default=None,
        description="The answer parsed, when the turn asked for structured output.",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )
    parent: TurnParent | None = Field(
        default=None,
        description="A child turn's parent (from its request).",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )
    prompt_version: str | None = Field(
        default=None,
        max_length=64,
        description="The agent's prompt version the turn started with.",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )
    models: tuple[str, ...] = Field(
        default=(),
        description="The model that answered each step, as the endpoint named it (steps that "
        "called no model, a workflow's, are left out).",
        exclude_if=lambda value: not value,  # added to v1: written only when set
    )

    @model_validator(mode="after")
    def _error_iff_failed(self) -> TurnResult:
        if (self.finish_reason == "error") != (self.error is not None):
            raise ValueError("error is set exactly when finish_reason is 'error'")
        return self


class TurnRejection(Contract):
    """A turn request the worker refused (dead-lettered on its first delivery), sent to the
    request's reply queue with AMQP ``type`` ``turn.rejection``, so a publisher waiting there
    for a ``TurnResult`` hears of it. The ids are the request's where they could be read:
    ``turn_id`` from its body, or the ``message_id`` it was published with when the body could
    not be read (oversize, not msgpack)."""

    schema_version: Literal[1] = 1
    turn_id: SafeId | None = None
    session_id: SafeId | None = None
    agent: AgentName | None = None
    code: str = Field(
        max_length=64, description="The dead letter's x-loopwire-reason-code (e.g. schema)."
    )
    reason: str = Field(max_length=2000)
    rejected_at: float
