"""Schedules the simulation (``test_simulation.py``) found breaking a promise, shrunk by
Hypothesis and kept as they were printed: each replays the same steps on a fresh world and
makes the checks it broke. Each failed before what it found was mended; it is kept for good."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.simulation.test_simulation import Simulation

Steps = list[tuple[str, dict[str, Any]]]


def replay(steps: Steps, checks: frozenset[str] = frozenset()) -> None:
    """The steps on a fresh world, then the ``checks`` named (all when empty)."""
    state = Simulation()
    state.only = checks
    try:
        for name, kwargs in steps:
            getattr(state, name)(**kwargs)
    except BaseException:
        state.loop.close()
        raise
    state.teardown()


def turn(agent: str, session: str = "A", turn: str = "t1", deadline: float | None = None) -> Any:
    return (
        "publish_turn",
        {"agent": agent, "session": session, "turn": turn, "deadline": deadline},
    )


def deliver(pick: int = 0, how: str = "ok", at: int = 1) -> Any:
    return ("deliver", {"pick": pick, "how": how, "at": at})


def advance(seconds: float) -> Any:
    return ("advance", {"seconds": seconds})


def _c(names: str) -> frozenset[str]:
    return frozenset(names.split(","))


SCHEDULES: dict[str, tuple[frozenset[str], Steps]] = {
    # a turn that starts near the end of its session's TTL loses its state mid-turn: the
    # expiry set when the previous turn ended is not renewed while it runs
    "a turn outlives its session keys' expiry": (
        _c("every_turn_ends_once,every_reply_queue_answered"),
        [
            turn("support"),
            deliver(),
            deliver(),
            deliver(),
            advance(3570.0),
            turn("support", turn="t2"),
            deliver(),
            deliver(),
            advance(61.0),
        ],
    ),
    # a sub-agent call under approval, rejected by its timeout, still starts its child
    "a sub-agent call under approval starts no child undecided": (
        _c("approved_children"),
        [turn("boss")],
    ),
    # an approved sub-agent call stays on the list of calls waiting for approval for good
    # (after the decision its step waits for the child, and nothing takes the entry off)
    "the list of calls waiting for approval keeps nothing for good": (
        _c("keys_expire"),
        [
            turn("boss"),
            deliver(),
            deliver(),
            ("decide", {"pick": 0, "verdict": "approve"}),
        ],
    ),
    # two sessions with one turn id share their tools' stored replies
    "two sessions with one turn id stay apart": (
        _c("sessions_apart,rejections"),
        [
            turn("support", session="B"),
            turn("support", session="A"),
        ],
    ),
    # a control message of a kind this worker does not know rejects the turn it names
    "an unknown control message rejects no turn": (
        _c("rejections"),
        [
            ("unknown_kind", {"session": "A", "turn": "t1"}),
            turn("support"),
        ],
    ),
    # any publisher can answer a parent's sub-agent call in the child's name
    "only a worker delivers a child's result": (
        _c("no_forgery"),
        [
            turn("lead"),
            deliver(),
            deliver(),
            ("forge_child_result", {"pick": 0}),
        ],
    ),
    # an approval's timeout message back a little early rejects the call before its until
    "an approval's wait never ends before its until": (
        _c("approvals"),
        [turn("payer")],
    ),
    # a recursive tree's tokens count twice in its agents' days (the parent's spend holds its
    # children's, and each child adds its own)
    "every model call counts once in the agents' days": (
        _c("daily_spend"),
        [turn("lead")],
    ),
    # an approval park waits its whole timeout (60 s) past a deadline 30 s away
    "an approval park ends by the turn's deadline": (
        _c("approvals"),
        [turn("payer", deadline=30.0)],
    ),
    # a worker dies right after the save of a step its own timeout message woke: the
    # redelivered timeout is dropped, the turn gets no next step and never ends
    "a redone timeout wake goes on": (
        _c("every_turn_ends_once"),
        [turn("payer"), deliver(), deliver(), advance(61.0), deliver(0, "crash", 3)],
    ),
    # ... and the same with Redis failing after that save
    "a timeout wake redone after a Redis error goes on": (
        _c("every_turn_ends_once"),
        [turn("payer"), deliver(), deliver(), advance(61.0), deliver(0, "redis", 4)],
    ),
    # a parent's cancel reaches its child before the child's request: the cancel is dropped
    # (unknown turn) and the child runs its tools after its parent ended
    "a child never outlives its parent's cancel": (
        _c("children_report_once"),
        [
            turn("lead"),
            deliver(),
            deliver(),
            ("cancel", {"session": "A", "turn": "t1"}),
            deliver(1),
            deliver(1),
            deliver(1),
            advance(0.5),
        ],
    ),
    # a child queued behind another in a named session, cancelled there before it starts:
    # its parent hears nothing, and waits out its children_timeout_s for an error
    "a child cancelled while queued in a named session reports to its parent": (
        _c("children_heard"),
        [
            turn("pool", session="A", turn="t1"),
            turn("pool", session="B", turn="t2"),
            deliver(),
            deliver(),
            deliver(),
            deliver(),
            deliver(),
            deliver(),
            ("cancel_child", {"pick": 1}),
            deliver(1),
        ],
    ),
    # a worker dies right after the save that parks a turn for its child: the redone step
    # starts the child again but never announces it (child.started is lost)
    "a child's start is announced though its parent's worker died after parking": (
        _c("children_announced,sessions_apart"),
        [turn("lead"), deliver(), deliver(0, "crash", 4)],
    ),
    # a worker dies right after it ended a queued turn for its cancel: the cancel comes back,
    # finds the turn finished and is dropped; its end is never announced nor answered
    "a cancel of a queued turn redone after its end repeats the end": (
        _c("every_turn_ends_once,every_reply_queue_answered"),
        [
            turn("support", turn="t1"),
            turn("support", turn="t2"),
            deliver(),
            deliver(),
            ("cancel", {"session": "A", "turn": "t2"}),
            deliver(1, "crash", 2),
        ],
    ),
    # a worker dies right after accepting a child whose parent had ended: the request comes
    # back as a copy, is kicked, and the child runs its tools for a parent long gone
    "a child accepted again after its parent ended runs nothing": (
        _c("children_report_once"),
        [
            turn("lead"),
            deliver(),
            deliver(),
            ("cancel", {"session": "A", "turn": "t1"}),
            deliver(1),
            deliver(1),
            deliver(1),
            deliver(0, "crash", 1),
            advance(0.5),
        ],
    ),
    # a decision is never lost: approved, the call runs; a copy of a rejection after it
    # changes nothing
    "a decision delivered while its call waits is what happens to the call": (
        _c("decisions_applied,tools_run_once"),
        [
            turn("payer"),
            deliver(),
            deliver(),
            ("decide", {"pick": 0, "verdict": "approve"}),
            ("decide", {"pick": 0, "verdict": "reject"}),
            deliver(0),
            deliver(0, "crash", 2),
        ],
    ),
    # a turn ended by its deadline whose worker died right after the end's save, while the
    # session's next turn started: the redone step found another turn running and was dropped
    # as stale, so the end was never announced nor its reply sent
    "a turn's end is repeated when the session runs its next turn": (
        _c("every_turn_ends_once,every_reply_queue_answered"),
        [
            turn("support", session="C", turn="t1", deadline=5.0),
            advance(5.0),
            deliver(0, "ok", 1),
            deliver(0, "crash", 3),
            turn("payer", session="C", turn="t2"),
            deliver(0, "redis", 1),
        ],
    ),
    # another session takes a finished turn's id once the turn's session index has lapsed
    # (twice the idle lifetime after the turn's end), as documented: not a broken promise
    "a turn id is free again once its session index has lapsed": (
        _c("rejections,every_turn_ends_once"),
        [
            turn("support", session="B", deadline=5.0),
            advance(5.0),
            deliver(),
            deliver(),
            advance(61.0),
            advance(3570.0),
            advance(3570.0),
            turn("support", session="A"),
        ],
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule(name: str) -> None:
    checks, steps = SCHEDULES[name]
    replay(steps, checks)
