"""A deterministic simulation of the sequencer and the consumer (Hypothesis stateful testing).

A schedule is a random sequence of what the world can do: publishers send turn requests
(some sessions reuse turn ids, some turns carry a deadline), cancels, decisions, forged child
results and control messages of kinds this worker does not know; the broker delivers any
waiting message, in any order, again after a crash or a lost ack; a worker dies right after
any write to the store (a save point) or Redis fails any one call; the clock moves past a
lease, an approval's timeout, a deadline or the session keys' TTL. Then the world settles
(everything left is delivered, without faults) and ``invariants.check`` says what broke.

A failing schedule is shrunk by Hypothesis and printed as the steps to replay; the ones found
so far stand as tests in ``test_schedules.py``. ``--hypothesis-profile=long`` (10,000
schedules) or ``LOOPWIRE_SIM_EXAMPLES=N`` runs longer, ``LOOPWIRE_SIM_CHECKS=a,b`` makes only
the named checks; see docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from contracts import topology as t
from contracts.codec import decode, encode, encode_obj
from contracts.control import TurnCancel, TurnChildResult, TurnDecision
from contracts.turns import InputMessage, TurnParent, TurnRequest, TurnResult
from tests.unit.simulation.invariants import FORGED, ROLLBACK, Record, check
from tests.unit.simulation.world import (
    AGENTS,
    APPROVAL_TIMEOUT_S,
    LEASE_TTL_S,
    SESSION_TTL_S,
    World,
)

SESSIONS = ("A", "B", "C")
TURN_IDS = ("t1", "t2", "t3")
STEPS = ("ok", "crash", "redis", "ack")


class Simulation(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.world = World()
        self.record = Record()
        self.only = _ONLY
        self.published_at: dict[tuple[str, str], float] = {}
        """When each (session, turn id) was first published."""
        """The checks to make at the end (all when empty)."""

    def run(self, coro: object) -> object:
        return self.loop.run_until_complete(coro)  # type: ignore[arg-type]

    # -- publishers ---------------------------------------------------------------------------

    @rule(
        session=st.sampled_from(SESSIONS),
        turn=st.sampled_from(TURN_IDS),
        agent=st.sampled_from(AGENTS),
        deadline=st.sampled_from((None, 5.0, 30.0, 120.0)),
    )
    def publish_turn(self, session: str, turn: str, agent: str, deadline: float | None) -> None:
        """A turn request; a turn id this session used before is the publisher's retry of that
        same request, within the sessions' idle lifetime (another session may reuse the id for
        a turn of its own)."""
        earlier = [r for r in self.record.requests if (r.session_id, r.turn_id) == (session, turn)]
        first = self.published_at.setdefault((session, turn), self.world.now)
        if self.world.now - first > SESSION_TTL_S - 60:
            return  # no publisher retries a request that long: a new turn takes a new id
        request = (
            earlier[0]
            if earlier
            else TurnRequest(
                turn_id=turn,
                session_id=session,
                agent=agent,
                input=(InputMessage(content=f"question {turn}"),),
                reply_to=f"client.{session}",
                deadline=None if deadline is None else self.world.now + deadline,
            )
        )
        self.record.requests.append(request)
        self.world.publish_turn(request)

    @rule(
        session=st.sampled_from(SESSIONS),
        turn=st.sampled_from(TURN_IDS),
        rollback=st.booleans(),
    )
    def cancel(self, session: str, turn: str, rollback: bool = False) -> None:
        """A publisher cancels a turn, keeping what it did or rolling it back."""
        cancel = TurnCancel(
            turn_id=turn,
            session_id=session,
            reason=ROLLBACK if rollback else "user",
            rollback=rollback,
        )
        self.world.publish(encode(cancel), t.KIND_CANCEL)

    @rule(pick=st.integers(0, 7), verdict=st.sampled_from(("approve", "reject", "edit")))
    def decide(self, pick: int, verdict: str) -> None:
        asked = [e for e in self.world.events.events if e.type == "approval.requested"]
        if not asked:
            return
        e = asked[pick % len(asked)]
        call = getattr(e.data, "call_id", "")
        decision = TurnDecision(
            turn_id=e.turn_id or "",
            session_id=e.session_id,
            call_id=call,
            decision=verdict,  # type: ignore[arg-type]
            arguments={"input": "edited"} if verdict == "edit" else None,
            by="reviewer",
        )
        if verdict != "reject":
            self.record.approved.add((e.turn_id or "", call))
        self.world.publish(encode(decision), t.KIND_DECISION)

    @rule(pick=st.integers(0, 7))
    def forge_child_result(self, pick: int) -> None:
        """Any publisher can read child.started and send a result in the child's name."""
        started = [e for e in self.world.events.events if e.type == "child.started"]
        if not started:
            return
        e = started[pick % len(started)]
        data = e.data
        parent = TurnParent(
            session_id=e.session_id or "",
            turn_id=e.turn_id or "",
            call_id=getattr(data, "call_id", ""),
            root_turn_id=e.root_turn_id or e.turn_id or "",
        )
        result = TurnResult(
            turn_id=getattr(data, "turn_id", ""),
            session_id=getattr(data, "session_id", ""),
            agent="helper",
            content=FORGED,
            finish_reason="stop",
            steps=1,
            duration_s=0.0,
            completed_at=self.world.now,
            parent=parent,
        )
        self.world.publish(
            encode(TurnChildResult(parent=parent, result=result)), t.KIND_CHILD_RESULT
        )

    @rule(pick=st.integers(0, 7))
    def cancel_child(self, pick: int) -> None:
        """A publisher cancels a child turn it saw start (queued, running or parked)."""
        started = [e for e in self.world.events.events if e.type == "child.started"]
        if not started:
            return
        data = started[pick % len(started)].data
        cancel = TurnCancel(
            turn_id=getattr(data, "turn_id", ""),
            session_id=getattr(data, "session_id", None),
            reason="user",
        )
        self.world.publish(encode(cancel), t.KIND_CANCEL)

    @rule(session=st.sampled_from(SESSIONS), turn=st.sampled_from(TURN_IDS))
    def unknown_kind(self, session: str, turn: str) -> None:
        """A control message from a newer publisher, of a kind this worker does not know."""
        body = encode_obj({"turn_id": turn, "session_id": session})
        self.world.publish(body, "turn.pause")

    # -- the broker, the workers and the clock ------------------------------------------------

    @precondition(lambda self: bool(self.world.deliverable()))
    @rule(pick=st.integers(0, 15), how=st.sampled_from(STEPS), at=st.integers(1, 6))
    def deliver(self, pick: int, how: str, at: int) -> None:
        ready = self.world.deliverable()
        index = ready[pick % len(ready)]
        message = self.world.bag[index]
        if how == "crash":
            self.world.faults.arm(crash_after=at)
        elif how == "redis":
            self.world.faults.arm(fail_call=at)
        live = self._live_cancel(message)
        waiting = self._waiting_decision(message)
        fired = self.run(self.world.deliver(index, ack_lost=how == "ack"))
        if live is not None and not fired:
            self.record.cancels.add(live)
        if waiting is not None and not fired:
            self.record.decided.append(waiting)

    def _waiting_decision(self, message: object) -> tuple[str, str, str, str] | None:
        """(session, turn, call, verdict) of a decision about to be delivered while its call
        waits for one."""
        if getattr(message, "kind", "") != t.KIND_DECISION:
            return None
        decision = decode(message.published.body, TurnDecision)  # type: ignore[attr-defined]
        if f"{decision.turn_id}:{decision.call_id}" not in self.world.memory.waiting_approvals:
            return None
        return (decision.session_id or "", decision.turn_id, decision.call_id, decision.decision)

    def _live_cancel(self, message: object) -> tuple[str, str] | None:
        """(session, turn) of a cancel about to be delivered while its turn has not ended."""
        if getattr(message, "kind", "") != t.KIND_CANCEL:
            return None
        cancel = decode(message.published.body, TurnCancel)  # type: ignore[attr-defined]
        session = cancel.session_id or ""
        accepted = (session, cancel.turn_id) in {
            (e.session_id, e.turn_id) for e in self.world.events.events if e.type == "turn.accepted"
        }
        ended = (session, cancel.turn_id) in self.world.memory.results
        return (session, cancel.turn_id) if accepted and not ended else None

    @precondition(lambda self: bool(self.world.bag))
    @rule(pick=st.integers(0, 15))
    def duplicate(self, pick: int) -> None:
        """The broker (or a publisher's retry) delivers a message twice."""
        message = self.world.bag[pick % len(self.world.bag)]
        self.world.bag.append(type(message)(message.published, due=message.due, at=message.at))

    @rule(
        seconds=st.sampled_from(
            (0.5, LEASE_TTL_S / 3, LEASE_TTL_S + 1, APPROVAL_TIMEOUT_S + 1, SESSION_TTL_S - 30)
        )
    )
    def advance(self, seconds: float) -> None:
        self.world.advance(seconds)

    def teardown(self) -> None:
        try:
            self.run(self.world.settle())
            broken = check(self.world, self.record, self.only)
            assert not broken, "\n".join(broken)
        finally:
            self.loop.close()


_EXAMPLES = int(os.environ.get("LOOPWIRE_SIM_EXAMPLES") or settings.default.max_examples)
_ONLY = frozenset(filter(None, os.environ.get("LOOPWIRE_SIM_CHECKS", "").split(",")))
"""The names of the checks to make (``invariants.CHECKS``, without the underscore): all by
default; one alone shows the shortest schedule that breaks it."""
TestSimulation = Simulation.TestCase
TestSimulation.pytestmark = [pytest.mark.timeout(max(600, _EXAMPLES))]  # type: ignore[attr-defined]
TestSimulation.settings = settings(
    max_examples=_EXAMPLES,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
