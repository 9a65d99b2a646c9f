"""Traces of turns, steps, model calls and tool calls, read from the OpenTelemetry SDK's
in-memory exporter: one trace per turn tree, the parents right, the GenAI attributes there,
contents only when asked for and never for an agent that redacts."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind
from world import Answer, calls, request, says, tool_results, world

from contracts.runtime.tracer_setup import ChosenIds
from contracts.runtime.tracing import configured
from contracts.tools import ToolContext
from worker.loop.ports import ModelRequest
from worker.runtime.tracing import Tracing

PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


def traced(**kwargs: Any) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=ChosenIds(), **kwargs.pop("provider", {}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, **kwargs), exporter


def named(spans: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def one_tool_then_answer(r: ModelRequest) -> Any:
    results = tool_results(r)
    if len(results) < 2:
        return calls(("lookup", f"q{len(results)}"))
    return says("done: " + ",".join(results))


ONE = {"agents": [{"name": "support"}]}


async def lookup(args: dict[str, Any], _ctx: ToolContext) -> Any:
    return {"found": args.get("input")}


TOOLS = {"lookup": lookup}


async def test_a_turn_is_one_trace_of_steps_model_calls_and_tool_calls() -> None:
    tracing, exporter = traced()
    w = world(ONE, {"support": one_tool_then_answer}, tools=TOOLS, tracing=tracing)
    await w.run(
        request(
            "support", "hi", traceparent=f"00-{PARENT_TRACE}-{PARENT_SPAN}-01", tracestate="k=v"
        )
    )
    assert w.result("T1").finish_reason == "stop"
    spans = exporter.get_finished_spans()
    assert len({s.context.trace_id for s in spans}) == 1
    assert f"{spans[0].context.trace_id:032x}" == PARENT_TRACE  # the publisher's trace
    [turn] = named(spans, "invoke_agent ")
    assert turn.name == "invoke_agent support"
    assert parent_id(turn) == int(PARENT_SPAN, 16)
    assert turn.attributes is not None
    assert turn.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert turn.attributes["gen_ai.agent.name"] == "support"
    assert turn.attributes["gen_ai.conversation.id"] == "S1"
    assert turn.attributes["gen_ai.usage.input_tokens"] == 30
    assert turn.attributes["loopwire.turn.finish_reason"] == "stop"
    steps = named(spans, "step ")
    assert len(steps) == 3
    assert all(parent_id(s) == turn.context.span_id for s in steps)
    assert [s.attributes and s.attributes["loopwire.step.index"] for s in steps] == [0, 1, 2]
    # the turn's span covers its steps
    assert turn.start_time is not None and turn.end_time is not None
    assert all(s.start_time and s.start_time >= turn.start_time - 1_000 for s in steps)
    chats = named(spans, "chat")
    assert len(chats) == 3
    by_id = {s.context.span_id: s for s in steps}
    assert all(parent_id(c) in by_id for c in chats)
    for chat in chats:
        assert chat.kind is SpanKind.CLIENT
        a = chat.attributes or {}
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.agent.name"] == "support"
        assert "gen_ai.request.model" in a and "gen_ai.response.model" in a
        assert a["gen_ai.usage.input_tokens"] == 10 and a["gen_ai.usage.output_tokens"] == 0
        assert a["gen_ai.response.finish_reasons"] in (("tool_calls",), ("stop",))
        assert "gen_ai.input.messages" not in a and "gen_ai.output.messages" not in a
    tools = named(spans, "execute_tool ")
    assert [t.name for t in tools] == ["execute_tool lookup"] * 2
    for tool in tools:
        a = tool.attributes or {}
        assert a["gen_ai.tool.name"] == "lookup" and str(a["gen_ai.tool.call.id"])
        assert parent_id(tool) in by_id
        assert tool.status.is_ok
    assert w.result("T1").content == 'done: {"found": "q0"},{"found": "q1"}'


async def test_a_turn_without_a_traceparent_is_a_root_and_its_events_unchanged() -> None:
    tracing, exporter = traced()
    w = world(ONE, {"support": lambda r: says("hello")}, tracing=tracing)
    await w.run(request("support", "hi"))
    [turn] = named(exporter.get_finished_spans(), "invoke_agent ")
    assert turn.parent is None
    assert w.result("T1").content == "hello"


async def test_a_child_turn_is_in_its_parents_trace_under_the_step_that_called_it() -> None:
    team = {"agents": [{"name": "lead", "agents": ["researcher"]}, {"name": "researcher"}]}

    def lead(r: ModelRequest) -> Any:
        return says("got " + tool_results(r)[0]) if tool_results(r) else calls(("researcher", "x"))

    answers: dict[str, Answer] = {"lead": lead, "researcher": lambda r: says("facts")}
    tracing, exporter = traced()
    w = world(team, answers, tracing=tracing)
    await w.run(request("lead", "go"))
    assert w.result("T1").content == "got facts"
    spans = exporter.get_finished_spans()
    assert len({s.context.trace_id for s in spans}) == 1
    turns = {s.name: s for s in named(spans, "invoke_agent ")}
    assert set(turns) == {"invoke_agent lead", "invoke_agent researcher"}
    lead_steps = {
        s.context.span_id
        for s in named(spans, "step lead")
        if parent_id(s) == turns["invoke_agent lead"].context.span_id
    }
    assert parent_id(turns["invoke_agent researcher"]) in lead_steps
    [child] = w.starts()
    assert child.traceparent is not None


@pytest.mark.parametrize(
    ("capture", "redacts", "recorded"),
    [(False, False, False), (True, False, True), (True, True, False)],
)
async def test_contents_only_when_asked_for_and_never_when_the_agent_redacts(
    capture: bool, redacts: bool, recorded: bool
) -> None:
    tracing, exporter = traced(capture=capture, redacts=lambda _agent: redacts)
    w = world(ONE, {"support": lambda r: says("the secret answer")}, tracing=tracing)
    await w.run(request("support", "my question"))
    [chat] = named(exporter.get_finished_spans(), "chat")
    a = chat.attributes or {}
    assert ("gen_ai.input.messages" in a) is recorded
    assert ("gen_ai.output.messages" in a) is recorded
    if recorded:
        assert "my question" in str(a["gen_ai.input.messages"])
        assert "the secret answer" in str(a["gen_ai.output.messages"])


async def test_a_trace_sampled_out_exports_nothing_and_the_turn_runs() -> None:
    tracing, exporter = traced(provider={"sampler": ALWAYS_OFF})
    w = world(ONE, {"support": one_tool_then_answer}, tools=TOOLS, tracing=tracing)
    await w.run(request("support", "hi"))
    result = w.result("T1")
    assert result.finish_reason == "stop" and result.steps == 3
    assert (result.content or "").startswith("done: ")
    assert exporter.get_finished_spans() == ()


def test_tracing_is_on_only_when_the_environment_asks() -> None:
    assert not configured({})
    assert not configured({"OTEL_SERVICE_NAME": "x"})
    assert configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert configured({"OTEL_TRACES_EXPORTER": "console"})
    assert not configured({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"})
    assert not configured({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"})
