"""What the sequencer does for a session's deletion that needs no Redis: a request that arrives
while its session is erased comes back later, and the child sessions a parent's turns start
are recorded with the parent (``tests.unit.world``, over a ``MemoryStore``)."""

from __future__ import annotations

import inspect

from contracts import keys
from contracts.state import ModelResponse
from tests.unit.world import calls, last_user, request, says, tool_results, world
from worker.loop.ports import ModelRequest
from worker.sequencing.actions import Busy, Start
from worker.session.records import _own_keys


async def test_a_request_sent_while_its_session_is_erased_comes_back_later() -> None:
    w = world({"agents": [{"name": "support"}]}, {"support": lambda r: says("hi")})
    eraser = await w.store.take("S1")
    assert eraser is not None
    w.store.erasing["S1"] = eraser.token

    assert await w.sequencer.on_request(request("support", "hello")) == [Busy()]
    assert w.events.events == []  # not announced: it was not accepted
    assert await w.store.head("S1") is None

    await w.store.release(eraser)  # the erasure ended (or its worker died)
    await w.drive([Start(request("support", "hello"))])
    assert w.result("T1").content == "hi"


def lead(r: ModelRequest) -> ModelResponse:
    if tool_results(r):
        return says("done")
    return calls(("researcher", "find A"), ("writer", "draft B"))


async def test_the_child_sessions_of_a_parent_are_recorded_with_it_but_a_named_one() -> None:
    profiles = {
        "agents": [
            {"name": "lead", "agents": ["researcher", {"agent": "writer", "session": "drafts"}]},
            {"name": "researcher"},
            {"name": "writer"},
        ]
    }
    answer = {"lead": lead, "researcher": lambda r: says(last_user(r))}
    w = world(profiles, {**answer, "writer": lambda r: says(last_user(r))})
    await w.run(request("lead", "go"))

    assert w.result("T1").content == "done"
    derived = next(r.session_id for r in w.starts() if r.agent == "researcher")
    assert w.store.children == {"S1": {derived}}


def test_an_erasure_names_every_key_a_session_has() -> None:
    """Every key ``contracts.keys`` builds under a session's hash tag is deleted by name (but
    the fence, kept so that fencing tokens never go back)."""
    session, turn_id = "s-erased", "t-erased"
    named = set(_own_keys(session, [turn_id]))
    named |= {keys.session_lease(session), keys.session_erasing(session)}  # the scripts' own
    named.add(keys.session_fence(session))  # kept, with its expiry
    built = set()
    for _, function in inspect.getmembers(keys, inspect.isfunction):
        params = list(inspect.signature(function).parameters)
        if params[:1] == ["session_id"]:
            args = {"session_id": session, "turn_id": turn_id}
            built.add(function(*(args[p] for p in params)))
    assert built and built <= named, sorted(built - named)
