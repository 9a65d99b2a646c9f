"""How the command line shows events and results: one readable line each, or JSON lines."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from contracts.events import (
    ChildFinished,
    ChildStarted,
    Event,
    StepCompleted,
    ToolInvoked,
    ToolInvoking,
    TurnFinished,
    TurnRejected,
)
from contracts.turns import TurnResult


def event_line(event: Event) -> str:
    """A one-line human summary of an event."""
    data = event.data
    head = f"{event.type:<15} {event.agent:<12} {event.turn_id or '-'}"
    if event.parent_turn_id:
        head += f" (child of {event.parent_turn_id})"
    if isinstance(data, ToolInvoking):
        return f"{head}  {data.tool} ({data.call_id})"
    if isinstance(data, ToolInvoked):
        tail = f"  {data.tool} ({data.call_id}) {data.outcome} in {data.duration_s * 1000:.1f} ms"
        if data.error:
            tail += f": {data.error[:120]}"
        return head + tail
    if isinstance(data, StepCompleted):
        return (
            f"{head}  step {event.step} {data.step_type}, {data.tool_calls} tool call(s), "
            f"model {data.model_duration_s:.2f} s, {data.usage.total_tokens} tokens"
        )
    if isinstance(data, TurnFinished):
        r = data.result
        return f"{head}  {r.finish_reason} after {r.steps} step(s) in {r.duration_s:.2f} s"
    if isinstance(data, TurnRejected):
        return f"{head}  {data.code}: {data.reason}"
    if isinstance(data, ChildStarted):
        return f"{head}  {data.agent} as {data.turn_id} ({data.call_id})"
    if isinstance(data, ChildFinished):
        return (
            f"{head}  {data.agent} {data.finish_reason} in {data.duration_s:.2f} s ({data.call_id})"
        )
    return head


def to_json(obj: Any) -> str:
    payload = obj.model_dump(mode="json") if hasattr(obj, "model_dump") else obj
    return json.dumps(payload, ensure_ascii=False, sort_keys=True)


def print_event(event: Event, *, as_json: bool, out: TextIO = sys.stdout) -> None:
    out.write((to_json(event) if as_json else event_line(event)) + "\n")
    out.flush()


def print_result(result: TurnResult, *, as_json: bool, out: TextIO = sys.stdout) -> None:
    if as_json:
        out.write(to_json({"result": result.model_dump(mode="json")}) + "\n")
    else:
        out.write((result.content or "") + "\n")
    out.flush()
