"""The small interfaces the loop runs over. Transports implement them; the loop knows nothing else."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, ParamSpec, Protocol

from contracts.events import Event
from contracts.messages import ChatMessage, Usage
from contracts.state import AgentState, ModelResponse, Spend, StepExecution
from contracts.tools import ToolCallReply, ToolCallRequest, ToolDefinition
from contracts.turns import TurnResult

log = logging.getLogger("loopwire.loop")
P = ParamSpec("P")

UNKNOWN_TOOL: Final = "_unknown"
"""How observers see a tool name the catalog did not offer (one the model invented)."""

ToolCallOutcome = Literal["ok", "error", "timeout", "unavailable", "blocked", "unknown"]
"""A tool call's outcome as observers see it: ``ToolExecution.outcome`` with the errors
``timeout`` (no reply in time) and ``unavailable`` (no service could take it) told apart."""


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """One chat-completions call: the compiled messages and the tools on offer."""

    messages: Sequence[ChatMessage]
    tools: Sequence[ToolDefinition] = ()
    model: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    """At most this long (the turn's deadline is near); ``None``: the client's own timeout."""
    provider: str | None = None
    """The provider to ask (``None``: ``default``)."""
    fallbacks: tuple[tuple[str, str | None], ...] = ()
    """The models to ask next, in order, when this one fails (provider, model)."""
    agent: str | None = None
    """The agent whose turn asks (for traces)."""
    stream: TextStream | None = None
    """Stream the answer's text here as it arrives (``worker.loop.streaming``); ``None``: the
    answer comes whole."""


class TextStream(Protocol):
    """Where a streaming model call sends the answer's text as it arrives."""

    def begin(self) -> None:
        """An attempt at the call starts (a retry drops what the earlier one sent)."""
        ...

    async def text(self, piece: str) -> None:
        """A piece of the answer's text."""
        ...

    async def end(self) -> None:
        """The answer is complete."""
        ...


class Model(Protocol):
    def complete(self, request: ModelRequest) -> Awaitable[ModelResponse]:
        """The model's answer; the awaitable raises ``ModelError`` when there is none.

        An adapter may take what it needs of ``request`` before it returns the awaitable (an
        HTTP adapter encodes the body), so that nothing holds the request while the model
        thinks."""
        ...


class ToolCaller(Protocol):
    async def call(self, request: ToolCallRequest, definition: ToolDefinition) -> ToolCallReply:
        """Run one tool call remotely. May raise; the loop turns every failure into an error result."""
        ...


class ToolCatalog(Protocol):
    async def available(self) -> Sequence[ToolDefinition]:
        """The tools that can be called right now."""
        ...

    def last_known(self, name: str) -> ToolDefinition | None:
        """The tool's definition as last seen, even when nothing offers it now."""
        ...


class EventSink(Protocol):
    async def emit(self, event: Event) -> None:
        """Publish a lifecycle event. Events only observe; a failure here must not change the turn."""
        ...


class Parked(Protocol):
    """A state put aside by its store while the model thinks (``StateStore.park``)."""

    def unpark(self) -> AgentState:
        """The state as it was parked (its version included)."""
        ...


class StateStore(Protocol):
    def park(self, state: AgentState) -> Parked:
        """Put ``state`` aside while the model thinks, in whatever form costs the store least to
        hold (the Redis store keeps the bytes it stores). Only a state as the store holds it is
        parked: the one it read, or the one a save returned."""
        ...

    async def list_waiting(self, state: AgentState) -> None:
        """``state``'s turn is parked for approval: its undecided calls go on the fleet-wide
        list of calls waiting for a decision (``loopwire approvals``), its decided ones off it
        (``worker.loop.approvals.waiting_list``). Done before the calls are announced, so that
        whoever hears of a call finds it listed."""
        ...

    def cancelled(self) -> bool:
        """Whether the step's turn has a cancel recorded, as far as the store knows without
        asking again (read with the lease, or by one of the step's saves): the step then
        dispatches no tool."""
        ...

    async def load_messages(self, state: AgentState) -> Sequence[ChatMessage]:
        """The conversation so far: session history before the turn plus this turn's messages
        (a ``worker.loop.transcript.StoredMessages`` spares building every message object)."""
        ...

    async def load_steps(self, state: AgentState) -> Sequence[StepExecution]:
        """The records of the turn's completed steps, as stored (``StepExecution.stored``):
        read only where a step needs earlier steps' records (a workflow's next round)."""
        ...

    async def save(
        self,
        state: AgentState,
        *,
        append: Sequence[ChatMessage] = (),
        result: TurnResult | None = None,
        release: bool = False,
        step: StepExecution | None = None,
        cut_to: int | None = None,
    ) -> AgentState:
        """Write ``state`` if nobody wrote since it was loaded; append this turn's new messages.

        ``cut_to`` (with a ``result``: a turn cancelled with rollback): the session's history
        is cut back to its first ``cut_to`` messages in the same atomic write, removing what
        the turn added.

        ``step``: the record of the step this save completes, appended once to the turn's
        step list in the same atomic write (the state counts it: a redone save is refused as
        stale, so a record is never appended twice).

        ``release``: the step's last write (nothing more is written until the next step), so
        the store may let go of what it holds for the step, e.g. a lease; so does a save with a
        ``result``.

        Returns the state as stored (its ``version`` advanced). Raises
        ``StaleStateError`` when another writer got there first.
        """
        ...


class LoopObserver:
    """What the loop reports as it runs (for metrics). Every method here does nothing.

    Methods are called on the event loop, inline: they must not block. One that raises is
    logged and ignored (``observe``); it never changes the turn.
    """

    def turn_started(self, agent: str) -> None:
        """A turn's first step began; its input messages were saved."""

    def turn_finished(self, result: TurnResult) -> None:
        """A turn ended (any finish reason) and its result was saved."""

    def step_completed(self, agent: str, duration_s: float) -> None:
        """A step ran to its end: model call, every tool result, guards, ``after_step``."""

    def model_called(
        self, model: str | None, usage: Usage, duration_s: float, provider: str = "default"
    ) -> None:
        """The model answered (``model``: the requested one; None means the provider's default;
        ``provider``: the one that answered)."""

    def model_failed(
        self, model: str | None, error_type: str, duration_s: float, provider: str = "default"
    ) -> None:
        """The model call failed for good; ``error_type`` is the ``ModelError`` code."""

    def tool_executed(self, tool: str, outcome: ToolCallOutcome, duration_s: float) -> None:
        """A tool call has its result; ``tool`` is an offered name or ``UNKNOWN_TOOL``."""

    def empty_streak_hints(self, agent: str, count: int) -> None:
        """The empty-streak guard appended ``count`` hints in one step."""

    def budget_exhausted(self, agent: str, budget: str) -> None:
        """A budget (``<scope>.<limit>``) was found spent before a model call."""

    def throttled(self, agent: str, reason: str) -> None:
        """A step parked its turn for a rate limit (``rate_limit``: the endpoint's,
        ``tenant_rate_limit``: its tenant's own, or the model's ``429``)."""

    def children_started(self, agent: str, count: int) -> None:
        """A step of ``agent``'s turn started ``count`` child turns and parked."""

    def iteration_cap_hit(self, agent: str) -> None:
        """The iteration cap ended a turn (``finish_reason: max_iterations``)."""


def observe(notify: Callable[P, None], *args: P.args, **kwargs: P.kwargs) -> None:
    """Call an observer method; a failure is logged, never raised into the loop."""
    try:
        notify(*args, **kwargs)
    except Exception:
        log.exception("loop observer %s failed", getattr(notify, "__name__", notify))


class SpendLedger(Protocol):
    """What each agent's finished turns spent, per day (UTC), fleet-wide: the daily budgets."""

    async def spent_today(self, agent: str) -> Spend: ...

    async def add_spent(self, agent: str, spend: Spend) -> None: ...


Price = Callable[[str | None, Usage], float]
"""The cost in USD of one model call's usage, by the model that was asked (``None``: the
worker's default model)."""


def free(_model: str | None, _usage: Usage) -> float:
    return 0.0


class RateLimiter(Protocol):
    """Admits model calls under the fleet-wide rate limits of the model endpoint."""

    async def admit(self, messages: Sequence[ChatMessage], max_tokens: int | None) -> float:
        """0 when the call may go now, else the seconds until its slot."""
        ...


class RefundableLimiter(RateLimiter, Protocol):
    """A ``RateLimiter`` that can give back what it charged (a tenant's own rate limits)."""

    async def refund(self, messages: Sequence[ChatMessage], max_tokens: int | None) -> None:
        """Give back what ``admit`` charged for a call that was not made after all."""
        ...
