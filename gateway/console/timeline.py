"""A turn's timeline, from three reads any service may make: the turn's step records
(``SessionQuery`` ``op: steps``: each model call and each tool call as recorded), the turn's
messages in the session's history (the tool results and answers, as stored: redacted where the
agent redacts), and the turn's events as the console's index kept them (tool attempts, waits
and their ends, child turns, the end).

A step record leaves out what the history holds (``StepExecution.stored``), so a tool call's
result is the history's tool message with the call's id, and a model call's answer the step's
assistant message, or the history's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from contracts.messages import ChatMessage
from contracts.steps import StepExecution
from contracts.turns import TurnResult

WAIT_STARTS = {"approval.requested", "child.started", "turn.throttled", "budget.exhausted"}
WAIT_ENDS = {"approval.decided", "child.finished"}
SHOWN = 4000
"""Characters of an argument list, a result or an answer shown before "… (n more)"."""


def clip(text: str | None) -> str:
    if text is None:
        return ""
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}… ({len(text) - SHOWN} more)"


@dataclass
class ToolCall:
    call_id: str
    name: str
    arguments: str
    outcome: str
    duration_s: float
    attempts: int
    result: str
    error: str | None


@dataclass
class ModelCall:
    index: int
    sent: str
    answer: str
    model: str
    provider: str
    prompt_tokens: int
    completion_tokens: int
    duration_s: float
    finish_reason: str
    cost_usd: float
    tools: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class Timeline:
    steps: list[ModelCall]
    waits: list[dict[str, Any]]
    children: list[dict[str, Any]]
    result: TurnResult | None
    expired: bool = False


def _arguments(value: Any) -> str:
    if value is None:
        return ""
    return clip(value if isinstance(value, str) else json.dumps(value, indent=2, sort_keys=True))


def build(
    records: list[StepExecution],
    messages: list[ChatMessage],
    events: list[dict[str, Any]],
    result: TurnResult | None,
    *,
    expired: bool = False,
) -> Timeline:
    results = {m.tool_call_id: m.content for m in messages if m.role == "tool" and m.tool_call_id}
    attempts: dict[str, int] = {}
    for event in events:
        if event["type"] == "tool.invoking":
            call_id = str(event.get("call_id"))
            attempts[call_id] = max(attempts.get(call_id, 0), int(event.get("attempt") or 1))
    steps: list[ModelCall] = []
    for record in records:
        step = record.step
        response = step.response
        answer = response.message.content if response is not None else None
        for message in step.output_messages:
            if message.role == "assistant" and message.content:
                answer = message.content
        usage = response.usage if response is not None else None
        plural = "" if step.input_count == 1 else "s"
        sent_to = f"{step.input_count} message{plural}"
        if step.sent_tokens is not None:
            sent_to += f", about {step.sent_tokens} tokens"
        if step.summarized:
            sent_to += ", older ones summarized"
        call = ModelCall(
            index=step.index,
            sent=sent_to,
            answer=clip(answer),
            model=response.model if response is not None else "",
            provider=(response.provider or "default") if response is not None else "",
            prompt_tokens=usage.prompt_tokens if usage is not None else 0,
            completion_tokens=usage.completion_tokens if usage is not None else 0,
            duration_s=response.duration_s if response is not None else 0.0,
            finish_reason=response.finish_reason if response is not None else "",
            cost_usd=response.cost_usd if response is not None else 0.0,
            errors=list(step.errors),
        )
        for ex in step.tool_executions:
            stored = results.get(ex.call_id) or ex.content
            call.tools.append(
                ToolCall(
                    call_id=ex.call_id,
                    name=ex.name,
                    arguments=_arguments(ex.arguments),
                    outcome=ex.outcome,
                    duration_s=max(0.0, ex.completed_at - ex.started_at),
                    attempts=attempts.get(ex.call_id, 1),
                    result=clip(stored),
                    error=ex.error,
                )
            )
        steps.append(call)
    waits = [e for e in events if e["type"] in WAIT_STARTS | WAIT_ENDS]
    children = [e for e in events if e["type"] == "child.started"]
    return Timeline(steps, waits, children, result, expired)
