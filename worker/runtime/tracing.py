"""A worker's spans (OpenTelemetry, GenAI semantic conventions), when tracing is on.

- ``invoke_agent <agent>``: one per turn, from its start to its end. Its ids are chosen when the
  turn starts and saved in its state (``ExecutionState.trace``); the worker that ends the turn
  makes the span with them, so a turn run by many workers is one span. Its parent is the turn
  request's ``traceparent`` (a child turn's: the parent's step).
- ``step <agent>``: one per step a worker runs (a step redone after a crash: one more), a
  child of its turn's span, current while the step runs, so that what the step does is its
  child:
- ``chat <model>``: each model call (``TracedModel``; a fallback is one more);
- ``execute_tool <tool>``: each tool call (``TracedTools``); the call's AMQP message carries the
  span on (``traceparent``), and the tool service's own span is its child. The events a step
  publishes carry it too.

Message contents are recorded (``gen_ai.input.messages``, ``gen_ai.output.messages``) only
when ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``, and never for an agent that
redacts. Off (no ``OTEL_*``), none of this is built: the worker makes no span.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context, attach, detach
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from contracts.runtime.tracer_setup import chosen_ids, start_tracing
from contracts.runtime.tracing import TRACEPARENT, TRACESTATE, context_of, inject
from contracts.state import AgentState, ModelResponse, TurnTrace
from contracts.tools import ToolCallReply, ToolCallRequest, ToolDefinition
from contracts.turns import TurnRequest, TurnResult
from worker.errors import ModelError
from worker.loop.ports import Model, ModelRequest, ToolCaller
from worker.settings import ModelSettings

CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
_IDS = RandomIdGenerator()


class Tracing:
    """The worker's tracer, and what it makes of turns and steps."""

    def __init__(
        self,
        provider: TracerProvider,
        *,
        redacts: Callable[[str], bool] = lambda _agent: False,
        capture: bool | None = None,
    ) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("loopwire.worker")
        self.redacts = redacts
        """Whether an agent redacts (its contents are never recorded)."""
        if capture is None:
            capture = os.environ.get(CAPTURE_CONTENT, "").strip().lower() == "true"
        self.capture = capture

    @classmethod
    def started(cls, redacts: Callable[[str], bool]) -> Tracing | None:
        """The worker's spans, when ``OTEL_*`` asks for them (``redacts``: an agent whose
        contents are never recorded)."""
        provider = start_tracing("loopwire-worker")
        return None if provider is None else cls(provider, redacts=redacts)

    def shutdown(self) -> None:
        self.provider.shutdown()  # exports what is still batched

    def records_content(self, agent: str | None) -> bool:
        return self.capture and agent is not None and not self.redacts(agent)

    def begin(self, state: AgentState) -> AgentState:
        """Choose the ids of a starting turn's span (its trace: the request's, or a new one)."""
        ex = state.execution
        if ex is None or ex.trace is not None:
            return state
        parent = context_of(ex.request.traceparent, ex.request.tracestate)
        remote = trace.get_current_span(parent).get_span_context() if parent else None
        trace_id = remote.trace_id if remote is not None else _IDS.generate_trace_id()
        decision = self.provider.sampler.should_sample(
            parent, trace_id, f"invoke_agent {ex.request.agent}", SpanKind.INTERNAL
        )
        chosen = TurnTrace(
            trace_id=f"{trace_id:032x}",
            span_id=f"{_IDS.generate_span_id():016x}",
            sampled=decision.decision is Decision.RECORD_AND_SAMPLE,
            started_at=ex.started_at,
        )
        return state.model_copy(update={"execution": ex.model_copy(update={"trace": chosen})})

    @contextlib.contextmanager
    def within(self, request: TurnRequest) -> Iterator[None]:
        """The publisher's span current (what is published for the request carries it)."""
        parent = context_of(request.traceparent, request.tracestate)
        if parent is None:
            yield
            return
        token = attach(parent)
        try:
            yield
        finally:
            detach(token)

    @contextlib.contextmanager
    def step(self, turn: TurnTrace | None, request: TurnRequest, index: int) -> Iterator[None]:
        """The step's span, current while it runs (none for a turn begun untraced)."""
        if turn is None:
            yield
            return
        parent = trace.set_span_in_context(NonRecordingSpan(_span_context(turn)), Context())
        with self.tracer.start_as_current_span(
            f"step {request.agent}",
            context=parent,
            attributes={
                "gen_ai.agent.name": request.agent,
                "gen_ai.conversation.id": request.session_id,
                "loopwire.turn.id": request.turn_id,
                "loopwire.step.index": index,
            },
        ):
            yield

    def ended(self, turn: TurnTrace | None, request: TurnRequest, result: TurnResult) -> None:
        """Make the turn's ``invoke_agent`` span, with the ids its start chose."""
        parent = context_of(request.traceparent, request.tracestate) or Context()
        if turn is None:  # ended before any step (cancelled while queued)
            ids = (_IDS.generate_trace_id(), _IDS.generate_span_id())
            started = result.completed_at
        else:
            ids = (int(turn.trace_id, 16), int(turn.span_id, 16))
            started = turn.started_at
        usage = result.usage
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": result.agent,
            "gen_ai.conversation.id": result.session_id,
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "loopwire.turn.id": result.turn_id,
            "loopwire.turn.steps": result.steps,
            "loopwire.turn.finish_reason": result.finish_reason,
        }
        with chosen_ids(*ids):
            span = self.tracer.start_span(
                f"invoke_agent {result.agent}",
                context=parent,
                kind=SpanKind.INTERNAL,
                attributes=attributes,
                start_time=int(started * 1e9),
            )
        if result.finish_reason == "error":
            code = result.error.code if result.error is not None else "error"
            span.set_attribute("error.type", code)
            span.set_status(Status(StatusCode.ERROR, code))
        span.end(end_time=int(max(result.completed_at, started) * 1e9))

    def stamped(self, request: TurnRequest) -> TurnRequest:
        """A child turn's request carrying the current span (the step that starts it)."""
        carrier: dict[str, str] = {}
        inject(carrier)
        if TRACEPARENT not in carrier:
            return request
        return request.model_copy(
            update={"traceparent": carrier[TRACEPARENT], "tracestate": carrier.get(TRACESTATE)}
        )

    def model(self, inner: Model, provider: str, endpoint: ModelSettings) -> Model:
        address = urlsplit(endpoint.base_url).hostname or ""
        return TracedModel(inner, self, provider, address, endpoint.model)

    def tools(self, inner: ToolCaller) -> ToolCaller:
        return TracedTools(inner, self)


def _span_context(turn: TurnTrace) -> SpanContext:
    return SpanContext(
        int(turn.trace_id, 16),
        int(turn.span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED if turn.sampled else TraceFlags.DEFAULT),
    )


class TracedModel:
    """``Model`` making a ``chat`` span of each call."""

    def __init__(
        self, inner: Model, tracing: Tracing, provider: str, address: str, default_model: str
    ) -> None:
        self.default_model = default_model
        """What the provider is asked for when the request names no model."""
        self.inner = inner
        self.tracing = tracing
        self.provider = provider
        self.address = address

    def complete(self, request: ModelRequest) -> Awaitable[ModelResponse]:
        model = request.model or self.default_model
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": model,
            "server.address": self.address,
            "loopwire.provider": self.provider,
        }
        if request.agent is not None:
            attributes["gen_ai.agent.name"] = request.agent
        if request.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = request.max_tokens
        if request.temperature is not None:
            attributes["gen_ai.request.temperature"] = request.temperature
        content = self.tracing.records_content(request.agent)
        if content:
            attributes["gen_ai.input.messages"] = json.dumps(
                [m.model_dump(mode="json", exclude_none=True) for m in request.messages]
            )
        return self._traced(self.inner.complete(request), model, attributes, content)

    async def _traced(
        self,
        answer: Awaitable[ModelResponse],
        model: str,
        attributes: dict[str, Any],
        content: bool,
    ) -> ModelResponse:
        name = f"chat {model}" if model else "chat"
        with self.tracing.tracer.start_as_current_span(
            name, kind=SpanKind.CLIENT, attributes=attributes
        ) as span:
            try:
                response = await answer
            except ModelError as exc:
                span.set_attribute("error.type", exc.code)
                raise
            usage = response.usage
            span.set_attributes(
                {
                    "gen_ai.response.model": response.model,
                    "gen_ai.response.finish_reasons": (response.finish_reason,),
                    "gen_ai.usage.input_tokens": usage.prompt_tokens,
                    "gen_ai.usage.output_tokens": usage.completion_tokens,
                }
            )
            if response.response_id:
                span.set_attribute("gen_ai.response.id", response.response_id)
            if content:
                message = response.message.model_dump(mode="json", exclude_none=True)
                span.set_attribute("gen_ai.output.messages", json.dumps([message]))
            return response


class TracedTools:
    """``ToolCaller`` making an ``execute_tool`` span of each call (current while it is out, so
    that the call's message carries it to the tool service)."""

    def __init__(self, inner: ToolCaller, tracing: Tracing) -> None:
        self.inner = inner
        self.tracing = tracing

    async def call(self, request: ToolCallRequest, definition: ToolDefinition) -> ToolCallReply:
        with self.tracing.tracer.start_as_current_span(
            f"execute_tool {request.tool}",
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": request.tool,
                "gen_ai.tool.call.id": request.call_id,
                "gen_ai.tool.type": "function",
            },
        ) as span:
            reply = await self.inner.call(request, definition)
            if reply.status != "ok":
                span.set_attribute("error.type", f"tool_{reply.status}")
                span.set_status(Status(StatusCode.ERROR, (reply.error or reply.status)[:200]))
            return reply
