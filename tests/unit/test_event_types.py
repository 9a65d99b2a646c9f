"""The events a platform chooses: the filter of LOOPWIRE_EVENTS, the opt-in model events,
state.updated, and the session's key-value state on tool calls."""

from __future__ import annotations

from typing import Any

from contracts.events import DEFAULT_EVENTS, EVENT_TYPES, MemoryUpdated, TurnRejected, make_event
from contracts.tools import ToolCallReply, ToolContext
from tests.unit.test_profiles import calls_tool
from tests.unit.world import request, says, world
from worker.testing.memory import ListSink
from worker.transport.events import FilteredSink, enabled_events


def test_the_filter_takes_patterns_and_defaults_to_all_but_the_model_events() -> None:
    assert enabled_events(None) == frozenset(DEFAULT_EVENTS)
    assert "model.requested" not in enabled_events(None)
    assert enabled_events([]) == frozenset()
    assert enabled_events(["turn.*", "model.*"]) == {
        t for t in EVENT_TYPES if t.startswith(("turn.", "model."))
    }


async def test_a_filtered_sink_publishes_only_what_is_enabled() -> None:
    inner = ListSink()
    sink = FilteredSink(inner, enabled_events(["turn.*"]))
    rejected = TurnRejected(reason="bad", code="schema")
    memory = MemoryUpdated(scope="session", memory_id="m", action="remembered")
    await sink.emit(make_event("turn.rejected", rejected, agent="a", time=1.0, turn_id="t"))
    await sink.emit(make_event("memory.updated", memory, agent="a", time=1.0, turn_id="t"))
    assert inner.types() == ["turn.rejected"]


async def test_model_events_when_enabled_and_state_for_tools() -> None:
    seen: list[dict[str, Any]] = []

    async def keep(args: dict[str, Any], ctx: ToolContext) -> Any:
        seen.append(dict(ctx.state))
        return ToolCallReply(
            call_id="-", status="ok", value={"kept": True}, state_updates={"step": args["x"]}
        )

    def run(announced: frozenset[str] | None) -> Any:
        asked = iter([calls_tool("keep", x=1), calls_tool("keep", x=2), says("done")])
        return world(
            {"agents": [{"name": "a", "limits": {"empty_streak_after": 0}}]},
            {"a": lambda r: next(asked)},
            tools={"keep": keep},
            announced=announced,
        )

    quiet = run(None)
    await quiet.run(request("a", "go"))
    assert not {"model.requested", "model.responded"} & set(quiet.events.types())
    updated = [e for e in quiet.events.events if e.type == "state.updated"]
    assert [e.data.keys for e in updated] == [("step",), ("step",)]  # type: ignore[union-attr]
    assert all(set(e.data.model_dump()) == {"call_id", "tool", "keys"} for e in updated)
    # the second call saw what the first set
    assert seen == [{}, {"step": 1}]

    loud = run(enabled_events(["*"]))
    await loud.run(request("a", "go"))
    types = loud.events.types()
    assert types.count("model.requested") == 3 and types.count("model.responded") == 3
    first = next(e for e in loud.events.events if e.type == "model.requested")
    assert (first.step, first.data.messages) == (0, 2)  # type: ignore[union-attr]
    answered = [e for e in loud.events.events if e.type == "model.responded"]
    assert [e.data.finish_reason for e in answered] == ["tool_calls", "tool_calls", "stop"]  # type: ignore[union-attr]


async def test_the_loop_builds_no_event_the_worker_does_not_publish() -> None:
    """The loop itself skips the types left out (before building them), so a turn whose worker
    publishes only turn.completed hands its sink nothing else; with every type left out the
    sink sees nothing at all, and the turn still ends."""

    async def keep(args: dict[str, Any], ctx: ToolContext) -> Any:
        return {"kept": args["x"]}

    def run(announced: frozenset[str]) -> Any:
        asked = iter([calls_tool("keep", x=1), says("done")])
        return world(
            {"agents": [{"name": "a"}]},
            {"a": lambda r: next(asked)},
            tools={"keep": keep},
            announced=announced,
        )

    some = run(frozenset({"turn.completed"}))
    first = request("a", "go")
    await some.run(first)
    assert some.result(first.turn_id).content == "done"
    loop_types = set(some.events.types()) - {"turn.accepted"}  # the sequencer's, not the loop's
    assert loop_types == {"turn.completed"}
    none = run(frozenset())
    second = request("a", "go")
    await none.run(second)
    assert none.result(second.turn_id).content == "done"
    assert set(none.events.types()) <= {"turn.accepted", "turn.completed"}
