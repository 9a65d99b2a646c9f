"""The console's pure pieces (gateway/console): whose an event is, its trace, what the timeline
keeps of it, and a turn's timeline assembled from its step records, history and events."""

from __future__ import annotations

from contracts.events import Event, ToolInvoking, TurnFinished
from contracts.messages import ChatMessage, ToolCall, Usage
from contracts.steps import AgentStep, ModelResponse, StepExecution, ToolExecution
from contracts.turns import TurnError, TurnResult
from gateway.console import timeline
from gateway.console.feed import trace_id
from gateway.console.index import record, tenant_of

RESULT = TurnResult(
    turn_id="T1",
    session_id="S1",
    agent="support",
    content="Found it.",
    finish_reason="stop",
    usage=Usage(prompt_tokens=30, completion_tokens=4, total_tokens=34),
    cost_usd=0.25,
    steps=2,
    duration_s=1.5,
    completed_at=1_700_000_002.0,
)


def test_an_events_tenant_is_the_first_of_five_words_else_the_default() -> None:
    assert tenant_of("shop.tool.invoked.support.t-1") == "shop"
    assert tenant_of("tool.invoked.support.t-1") == "default"
    assert tenant_of("session.deleted.support._unknown") == "default"


def test_the_trace_id_comes_from_a_valid_traceparent_only() -> None:
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert trace_id({"traceparent": parent}) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id({"traceparent": parent.encode()}) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id({"traceparent": "garbage"}) is None
    assert trace_id({}) is None


def test_a_turns_end_keeps_its_outcome_and_the_error_message() -> None:
    failed = RESULT.model_copy(
        update={"finish_reason": "error", "error": TurnError(code="model", message="down")}
    )
    event = Event(
        id="e1",
        type="turn.failed",
        time=1.0,
        agent="support",
        turn_id="T1",
        session_id="S1",
        data=TurnFinished(result=failed),
    )
    kept = record(event)
    assert kept["finish_reason"] == "error" and kept["error"] == "down"
    assert kept["cost_usd"] == 0.25 and kept["steps"] == 2
    assert "content" not in kept, "an answer is read from the session, not kept twice"


def test_a_timeline_takes_results_from_the_history_and_attempts_from_the_events() -> None:
    call = ToolCall(id="c1", name="lookup", arguments='{"q": "shoes"}')
    asked = ChatMessage(role="assistant", content=None, tool_calls=(call,))
    step = AgentStep(
        index=0,
        input_count=1,
        response=ModelResponse(
            message=asked,
            finish_reason="tool_calls",
            usage=Usage(prompt_tokens=12, completion_tokens=3, total_tokens=15),
            model="m",
            duration_s=0.5,
            cost_usd=0.01,
        ),
        tool_executions=(
            ToolExecution(
                call_id="c1",
                name="lookup",
                arguments={"q": "shoes"},
                outcome="ok",
                content="",
                started_at=10.0,
                completed_at=10.25,
            ),
        ),
    )
    records = [StepExecution(step=step, started_at=9.5, completed_at=10.3)]
    history = [ChatMessage(role="tool", content='{"results": ["shoes"]}', tool_call_id="c1")]
    events = [
        {
            "type": "tool.invoking",
            **ToolInvoking(tool="lookup", call_id="c1", attempt=2).model_dump(),
        },
        {"type": "approval.requested", "call_id": "c1", "tool": "lookup", "time": 9.9},
    ]
    view = timeline.build(records, history, events, RESULT)
    [model_call] = view.steps
    assert (model_call.sent, model_call.prompt_tokens, model_call.cost_usd) == (
        "1 message",
        12,
        0.01,
    )
    [tool] = model_call.tools
    assert (tool.result, tool.attempts, tool.duration_s) == ('{"results": ["shoes"]}', 2, 0.25)
    assert '"q": "shoes"' in tool.arguments
    assert [w["type"] for w in view.waits] == ["approval.requested"]
    assert view.result is RESULT
