"""Samples of the event data added after the first release, shared by the codec and the
contract tests."""

from __future__ import annotations

from contracts.events import (
    ChildFinished,
    ChildStarted,
    EventData,
    MemoryUpdated,
    MessageDelta,
    ModelRequested,
    ModelResponded,
    SessionDeleted,
    StateUpdated,
    TurnThrottled,
)
from contracts.messages import Usage

LATER_EVENT_DATA: dict[str, EventData] = {
    "model.requested": ModelRequested(model="gpt-x", messages=12, estimated_tokens=900),
    "model.responded": ModelResponded(
        model="gpt-x-2026", finish_reason="tool_calls", usage=Usage(), duration_s=0.75
    ),
    "message.delta": MessageDelta(seq=3, text="the answer so", restarted=True),
    "state.updated": StateUpdated(call_id="call_1", tool="keep", keys=("cart", "step")),
    "memory.updated": MemoryUpdated(scope="user", memory_id="m1", action="remembered"),
    "session.deleted": SessionDeleted(
        session_id="S1", reason="erasure request", by="dpo", deleted_keys=12
    ),
    "child.started": ChildStarted(
        call_id="call_1", turn_id="T1-c1", session_id="S1-c1", agent="researcher"
    ),
    "child.finished": ChildFinished(
        call_id="call_1",
        turn_id="T1-c1",
        agent="researcher",
        finish_reason="stop",
        usage=Usage(),
        cost_usd=0.25,
        duration_s=1.5,
    ),
    "turn.throttled": TurnThrottled(until=1_700_000_030.5),
}
