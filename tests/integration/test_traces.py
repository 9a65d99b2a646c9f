"""One turn, one trace: a turn with two tool steps, begun by one worker and finished by
another (the first is SIGKILLed mid-step), its tool calls served by the calculator service,
every process exporting over OTLP/HTTP to a receiver in this test. The publisher's span is
the turn's parent; steps, model calls and tool calls nest under it; the tool service's span is
the child of the worker's call; the events carry the trace."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from redis.asyncio import Redis
from support_rpc import wait_announced

from contracts.client import LoopwireClient
from harness import EventRecorder, WorkerProcess, free_port, write_agents
from worker.testing.replies import Reply
from worker.testing.scripted_model import ScriptedModel

pytestmark = pytest.mark.timeout(120)


class Receiver:
    """A small OTLP/HTTP trace receiver: every span exported to it, with its service."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.port = free_port()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._export)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def _export(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(
                        {
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex() or None,
                            "kind": span.kind,
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "service": resource.get("service.name"),
                            "instance": resource.get("service.instance.id"),
                        }
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def named(self, prefix: str) -> list[dict[str, Any]]:
        return [s for s in self.spans if s["name"].startswith(prefix)]

    async def until(self, check: Callable[[], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"spans not exported in time: {[s['name'] for s in self.spans]}"
                )
            await asyncio.sleep(0.05)


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, kind) if kind else None


def otel_env(receiver: Receiver, instance: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_RESOURCE_ATTRIBUTES": f"service.instance.id={instance}",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }


async def test_a_turn_across_two_workers_and_a_tool_service_is_one_trace(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    redis: Redis,
    spawn: Callable[..., Awaitable[Any]],
    uid: str,
    tmp_path: Path,
) -> None:
    receiver = Receiver()
    await receiver.start()

    def script(body: dict[str, Any]) -> Reply:
        number = len(scripted_model.requests)
        if number == 1:
            return replace(Reply.tool_calls(("calculate", {"expression": "6*7"})), usage=(20, 4))
        if number == 2:  # the first worker's second step: it dies waiting for this answer
            return Reply.text("never seen", delay=60)
        if number == 3:
            return replace(Reply.tool_calls(("calculate", {"expression": "1+1"})), usage=(30, 4))
        return Reply.text("42 and 2", usage=(40, 3))

    scripted_model.respond_with(script)
    calculator = await spawn(
        "tool_services.calculator", tool="calculate", env=otel_env(receiver, "calculator")
    )
    agents = write_agents(tmp_path / "agents.json", ["calculate"])
    first = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents,
        extra_env={**otel_env(receiver, "first"), "LOOPWIRE_PREFETCH": "1"},
    )
    second = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents,
        extra_env=otel_env(receiver, "second"),
    )
    events = EventRecorder()
    await events.start()
    publisher = TracerProvider().get_tracer("publisher")
    try:
        await wait_announced(redis, "calculator")
        await first.start()
        with publisher.start_as_current_span("publish the question") as root:
            handle = await client.start_turn(
                "support", "what is 6*7 and 1+1?", session_id=f"s-{uid}"
            )
        origin = root.get_span_context()
        await scripted_model.wait_for_requests(2, timeout=30)
        # the first step's spans are exported; then the worker dies in the middle of the second
        await receiver.until(lambda: any(s["instance"] == "first" for s in receiver.named("step ")))
        first.kill()
        await second.start()
        result = await handle.result(60)
        await handle.close()
    finally:
        first.close()
        second.terminate()
        calculator.signal(signal.SIGTERM)
        await calculator.wait()
        await events.stop()

    assert result.finish_reason == "stop" and result.content == "42 and 2"
    trace_id = f"{origin.trace_id:032x}"
    await receiver.until(lambda: len(receiver.named("invoke_agent ")) == 1)
    await receiver.until(lambda: len(receiver.named("execute_tool ")) >= 4)
    await receiver.stop()
    spans = [s for s in receiver.spans if s["trace_id"] == trace_id]
    assert spans and len(spans) == len(receiver.spans)  # one trace, the publisher's

    [turn] = receiver.named("invoke_agent ")
    assert turn["name"] == "invoke_agent support"
    assert turn["parent"] == f"{origin.span_id:016x}"
    assert turn["instance"] == "second"  # begun by the first worker, made by the one that ended it
    assert turn["attributes"]["gen_ai.agent.name"] == "support"
    assert turn["attributes"]["gen_ai.usage.input_tokens"] == 20 + 30 + 40

    steps = receiver.named("step ")
    assert {s["parent"] for s in steps} == {turn["span_id"]}
    by_step = {(s["instance"], s["attributes"]["loopwire.step.index"]) for s in steps}
    assert ("first", 0) in by_step and ("second", 1) in by_step and ("second", 2) in by_step
    step_ids = {s["span_id"] for s in steps}

    chats = receiver.named("chat")
    assert all(c["parent"] in step_ids for c in chats)
    answered = [c for c in chats if "gen_ai.response.model" in c["attributes"]]
    assert len(answered) == 3
    for chat in answered:
        a = chat["attributes"]
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.agent.name"] == "support"
        assert a["gen_ai.request.model"] and a["gen_ai.response.model"]
        assert a["gen_ai.usage.input_tokens"] in (20, 30, 40)
        assert a["gen_ai.usage.output_tokens"] in (3, 4)
        assert a["gen_ai.response.finish_reasons"] in (("tool_calls",), ("stop",))
        assert "gen_ai.input.messages" not in a  # contents are not recorded unless asked for

    calls = [s for s in receiver.named("execute_tool ") if s["service"] == "loopwire-worker"]
    served = [
        s for s in receiver.named("execute_tool ") if s["service"] == "loopwire-tool-calculator"
    ]
    assert len(calls) == 2 and len(served) == 2
    assert all(c["parent"] in step_ids for c in calls)
    for call in calls:
        assert call["attributes"]["gen_ai.tool.name"] == "calculate"
        assert call["attributes"]["gen_ai.tool.call.id"]
    assert {s["parent"] for s in served} == {c["span_id"] for c in calls}

    # every event of the turn carries its trace
    headers = [
        h for e, h in zip(events.events, events.headers, strict=True) if e.turn_id == handle.turn_id
    ]
    assert headers and all(str(h.get("traceparent", "")).split("-")[1] == trace_id for h in headers)
