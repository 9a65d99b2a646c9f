"""Lifecycle events published on the ``loopwire.events`` topic exchange.

An event is a CloudEvents 1.0 event in binary mode: its attributes travel as
AMQP headers (``ce-id``, ``ce-type``, ``ce-source``, ``ce-time``,
``ce-specversion``, ``ce-subject``), its body is this ``Event`` encoded with
msgpack. Event ids are deterministic (a UUIDv5 of type, turn, step and call),
so an event re-published after a redelivered step carries the same id and a
consumer can drop the duplicate. The routing key is
``<entity>.<action>.<agent>.<turn_id>``.
"""

from __future__ import annotations

import hashlib
import uuid
from datetime import UTC, datetime
from typing import Literal

from pydantic import Field

from contracts.base import AgentName, Contract, SafeId
from contracts.messages import Usage
from contracts.state import StepType, ToolOutcome
from contracts.turns import FinishReason, TurnParent, TurnResult

EventType = Literal[
    "turn.accepted",
    "turn.started",
    "step.completed",
    "tool.invoking",
    "tool.invoked",
    "turn.completed",
    "turn.failed",
    "turn.rejected",
    "turn.cancelled",
    "approval.requested",
    "approval.decided",
    "turn.throttled",
    "budget.exhausted",
    "child.started",
    "child.finished",
    "session.deleted",
    "memory.updated",
    "model.requested",
    "model.responded",
    "state.updated",
    "message.delta",
]
EVENT_TYPES: tuple[EventType, ...] = EventType.__args__  # type: ignore[attr-defined]
OPT_IN_EVENTS: tuple[EventType, ...] = ("model.requested", "model.responded")
"""Published only when ``LOOPWIRE_EVENTS`` names them (two more publishes a step)."""
DEFAULT_EVENTS: tuple[EventType, ...] = tuple(t for t in EVENT_TYPES if t not in OPT_IN_EVENTS)

EVENT_SOURCE = "/loopwire/worker"
UNKNOWN = "_unknown"
_NAMESPACE = uuid.UUID("5d0c0b8e-7a51-4f43-9d1e-6c1f1f0f7a11")
_NAMESPACE_BYTES = _NAMESPACE.bytes


class TurnAccepted(Contract):
    persist: bool
    input_messages: int


class TurnStarted(Contract):
    history_len: int
    max_tool_iterations: int
    prompt_version: str | None = Field(
        default=None,
        description="The agent's prompt version the turn started with.",
        exclude_if=lambda value: value is None,
    )


class StepCompleted(Contract):
    step_type: StepType
    finish_reason: str
    tool_calls: int
    usage: Usage
    duration_s: float
    model_duration_s: float
    model: str | None = Field(
        default=None,
        description="The model that answered, as the endpoint named it.",
        exclude_if=lambda value: value is None,
    )
    cost_usd: float = Field(
        default=0.0,
        ge=0,
        description="What the step's model call cost, from the workers' price table.",
        exclude_if=lambda cost: cost == 0.0,  # added to v1: written only when set
    )
    provider: str | None = Field(
        default=None,
        description="The provider that answered, when not 'default'.",
        exclude_if=lambda value: value is None,
    )
    input_messages: int | None = Field(
        default=None,
        description="With a context budget: the messages the model was sent.",
        exclude_if=lambda value: value is None,
    )
    input_tokens_estimate: int | None = Field(
        default=None,
        description="With a context budget: the estimated tokens the model was sent.",
        exclude_if=lambda value: value is None,
    )
    summarized: bool = Field(
        default=False,
        description="Whether a summary was sent in place of older messages.",
        exclude_if=lambda value: not value,
    )


class ToolInvoking(Contract):
    tool: str
    call_id: str
    attempt: int = 1


class ToolInvoked(Contract):
    tool: str
    call_id: str
    outcome: ToolOutcome
    duration_s: float
    truncated: bool = False
    error: str | None = None
    unresolved_placeholders: tuple[str, ...] = Field(
        default=(),
        max_length=32,
        description="Placeholders the redaction hook could not restore; the tool got them as "
        "written.",
    )


class TurnFinished(Contract):
    result: TurnResult


class ApprovalRequested(Contract):
    call_id: str
    tool: str
    arguments: str = Field(description="As the model wrote them (redacted when the agent redacts).")
    until: float | None = Field(default=None, description="When the call is rejected undecided.")


class TurnThrottled(Contract):
    """A turn parked, holding no worker, until the model may be asked again (a rate limit of
    the endpoint or of the tenant, or the endpoint's 429)."""

    until: float = Field(description="When its step is taken again.")


class ApprovalDecided(Contract):
    call_id: str
    decision: Literal["approve", "reject", "edit"]
    by: str | None = None
    message: str | None = None


class BudgetExhausted(Contract):
    budget: str = Field(
        description="'<scope>.<limit>': scope turn, session, agent_day or tenant_day."
    )
    limit: float
    used: float
    final_call: bool = Field(description="Whether one last model call (without tools) follows.")


class ChildStarted(Contract):
    """A turn started a child turn for one of its calls (a sub-agent, a workflow node)."""

    call_id: str
    turn_id: SafeId = Field(description="The child's turn id.")
    session_id: SafeId = Field(description="The child's session.")
    agent: AgentName = Field(description="The child's agent (or workflow).")


class ChildFinished(Contract):
    """A child turn's result reached its parent."""

    call_id: str
    turn_id: SafeId
    agent: AgentName
    finish_reason: FinishReason
    usage: Usage
    cost_usd: float = 0.0
    duration_s: float


class SessionDeleted(Contract):
    """A session was deleted: everything of it is gone from Redis."""

    session_id: SafeId
    reason: str
    by: str | None = None
    deleted_keys: int


class MemoryUpdated(Contract):
    """The memory service remembered or forgot a memory (never its text)."""

    scope: Literal["session", "user", "agent"]
    memory_id: str
    action: Literal["remembered", "forgotten"]


class ModelRequested(Contract):
    """A step is about to call the model."""

    model: str | None = Field(description="The model asked for (None: the provider's default).")
    messages: int
    estimated_tokens: int | None = Field(
        default=None, description="With a context budget: the estimate of what is sent."
    )


class ModelResponded(Contract):
    """The model answered a step (the answer is saved)."""

    model: str = Field(description="As the endpoint named it.")
    finish_reason: str
    usage: Usage
    duration_s: float


class StateUpdated(Contract):
    """A tool's state_updates changed the session's key-value state: which keys (never the
    values)."""

    call_id: str
    tool: str
    keys: tuple[str, ...]


class MessageDelta(Contract):
    """Text of a step's answer as the model streams it (the event's ``step``), coalesced: a
    publish carries what arrived since the last. ``seq`` counts the step's deltas from 0;
    ``restarted``: the step's text starts over with this delta (a worker redid the step, or
    the model was asked again): drop what arrived of the step before it."""

    seq: int = Field(ge=0)
    text: str
    restarted: bool = Field(default=False, exclude_if=lambda value: not value)


class TurnRejected(Contract):
    reason: str = Field(max_length=2000)
    code: str = Field(max_length=64)


EventData = (
    TurnAccepted
    | TurnStarted
    | StepCompleted
    | ToolInvoking
    | ToolInvoked
    | TurnFinished
    | TurnRejected
    | ApprovalRequested
    | ApprovalDecided
    | TurnThrottled
    | BudgetExhausted
    | ChildStarted
    | ChildFinished
    | SessionDeleted
    | MemoryUpdated
    | ModelRequested
    | ModelResponded
    | StateUpdated
    | MessageDelta
)


class Event(Contract):
    """One lifecycle event."""

    schema_version: Literal[1] = 1
    id: str
    type: EventType
    source: str = EVENT_SOURCE
    time: float
    agent: AgentName | Literal["_unknown"] = Field(
        description="The agent, or '_unknown' when it could not be read (it is in the routing key)."
    )
    turn_id: SafeId | None = None
    session_id: SafeId | None = None
    step: int | None = None
    parent_turn_id: SafeId | None = Field(
        default=None,
        description="Set on a child turn's events: the turn that started it.",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )
    root_turn_id: SafeId | None = Field(
        default=None,
        description="Set on a child turn's events: the turn at the root of its tree.",
        exclude_if=lambda value: value is None,  # added to v1: written only when set
    )
    data: EventData

    @property
    def routing_key(self) -> str:
        entity, action = self.type.split(".")
        return f"{entity}.{action}.{self.agent}.{self.turn_id or UNKNOWN}"

    def headers(self) -> dict[str, str]:
        """CloudEvents binary-mode attributes as AMQP headers."""
        headers = {
            "ce-specversion": "1.0",
            "ce-id": self.id,
            "ce-type": self.type,
            "ce-source": self.source,
            "ce-time": datetime.fromtimestamp(self.time, UTC).isoformat().replace("+00:00", "Z"),
        }
        if self.turn_id:
            headers["ce-subject"] = self.turn_id
        if self.parent_turn_id:  # CloudEvents extension attributes
            headers["ce-parentturnid"] = self.parent_turn_id
        if self.root_turn_id:
            headers["ce-rootturnid"] = self.root_turn_id
        return headers


def event_id(
    event_type: str, turn_id: str | None, step: int | None = None, call_id: str = ""
) -> str:
    """The deterministic id of an event: the same occurrence always gets the same id."""
    key = f"{event_type}/{turn_id or UNKNOWN}/{'' if step is None else step}/{call_id}"
    return _uuid5(key)


def _uuid5(name: str) -> str:
    """``str(uuid.uuid5(_NAMESPACE, name))`` without building a ``UUID`` (which costs a good
    part of an event on the step's path): the SHA-1 of namespace and name, version and variant
    bits set, in the 8-4-4-4-12 form."""
    h = hashlib.sha1(_NAMESPACE_BYTES + name.encode(), usedforsecurity=False).hexdigest()
    variant = "89ab"[int(h[16], 16) & 0x3]
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{variant}{h[17:20]}-{h[20:32]}"


def make_event(
    event_type: EventType,
    data: EventData,
    *,
    agent: str,
    time: float,
    turn_id: str | None = None,
    session_id: str | None = None,
    step: int | None = None,
    call_id: str = "",
    id_suffix: str = "",
    parent: TurnParent | None = None,
) -> Event:
    """Build an event with its deterministic id; ``parent``: the turn's, when it is a child."""
    if parent is not None:
        return Event(
            id=event_id(event_type, turn_id, step, call_id + id_suffix),
            type=event_type,
            time=time,
            agent=agent,
            turn_id=turn_id,
            session_id=session_id,
            step=step,
            parent_turn_id=parent.turn_id,
            root_turn_id=parent.root_turn_id,
            data=data,
        )
    return Event(
        id=event_id(event_type, turn_id, step, call_id + id_suffix),
        type=event_type,
        time=time,
        agent=agent,
        turn_id=turn_id,
        session_id=session_id,
        step=step,
        data=data,
    )


def finish_event_type(reason: FinishReason) -> EventType:
    if reason == "error":
        return "turn.failed"
    return "turn.cancelled" if reason == "cancelled" else "turn.completed"
