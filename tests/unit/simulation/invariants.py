"""What must hold after any schedule of the sequencer's simulation, once the world settled.

Each check returns the broken promises it found, as sentences a reader can act on; a schedule
passes when there are none. They read only what a user could see or what Redis would hold:
the events, the replies, the dead letters, the tool service's executions, the model's
requests and the store's keys.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

from contracts import topology as t
from contracts.codec import decode, decode_obj
from contracts.control import TurnChildResult
from contracts.events import Event
from contracts.turns import TurnRequest, TurnResult
from tests.unit.simulation.world import CAP, DAILY, SESSION_TTL_S, World

FORGED = "FORGED"
_OWNER = re.compile(r"for ([A-Za-z0-9_.:-]+)/")
FINISH_TYPES = frozenset({"turn.completed", "turn.failed", "turn.cancelled"})


@dataclass
class Record:
    """What the schedule's publishers did, for the checks."""

    requests: list[TurnRequest] = field(default_factory=list)
    cancels: set[tuple[str, str]] = field(default_factory=set)
    """(session, turn) of every cancel delivered (and acked) while its turn had not ended."""
    approved: set[tuple[str, str]] = field(default_factory=set)
    """(turn, call) of every approve or edit decision published."""
    decided: list[tuple[str, str, str, str]] = field(default_factory=list)
    """(session, turn, call, verdict) of every decision delivered (and acked) while its call
    waited for one."""


def check(world: World, record: Record, only: frozenset[str] = frozenset()) -> list[str]:
    """The broken promises; ``only``: the names of the checks to make (all when empty)."""
    broken: list[str] = []
    for checker in CHECKS:
        if not only or checker.__name__.lstrip("_") in only:
            broken += checker(world, record)
    return broken


def _checks() -> tuple[Callable[[World, Record], list[str]], ...]:
    return (
        _every_turn_ends_once,
        _every_reply_queue_answered,
        _queues_drain,
        _tools_run_once,
        _sessions_apart,
        _no_forgery,
        _children_report_once,
        _children_heard,
        _children_announced,
        _cancels_applied,
        _rollbacks_applied,
        _history_counted,
        _approvals,
        _approved_children,
        _decisions_applied,
        _keys_expire,
        _steps_recorded_once,
        _daily_spend,
        _rejections,
        _tenant_cap,
    )


def _by_turn(world: World) -> dict[tuple[str | None, str | None], list[Event]]:
    events: dict[tuple[str | None, str | None], list[Event]] = defaultdict(list)
    for e in world.events.events:
        events[e.session_id, e.turn_id].append(e)
    return events


def _accepted(world: World) -> set[tuple[str, str]]:
    return {
        (e.session_id, e.turn_id)
        for e in world.events.events
        if e.type == "turn.accepted" and e.session_id and e.turn_id
    }


def _results(world: World) -> dict[tuple[str, str], TurnResult]:
    results: dict[tuple[str, str], TurnResult] = {}
    for e in world.events.events:
        if e.type in FINISH_TYPES and e.session_id and e.turn_id:
            results[e.session_id, e.turn_id] = e.data.result  # type: ignore[union-attr]
    return results


def _every_turn_ends_once(world: World, record: Record) -> list[str]:
    broken = []
    events = _by_turn(world)
    for turn in sorted(_accepted(world)):
        ends = {e.id for e in events[turn] if e.type in FINISH_TYPES}
        if len(ends) != 1:
            broken.append(f"turn {turn} was accepted and ended {len(ends)} times (ids {ends})")
        after = [e for e in events[turn] if e.type == "step.completed"]
        ended = [i for i, e in enumerate(events[turn]) if e.type in FINISH_TYPES]
        if ended and after and events[turn].index(after[-1]) > ended[0]:
            broken.append(f"turn {turn}: a step.completed came after the turn's end")
    return broken


def _every_reply_queue_answered(world: World, record: Record) -> list[str]:
    broken = []
    accepted = _accepted(world)
    for request in record.requests:
        turn = (request.session_id, request.turn_id)
        if turn not in accepted or request.reply_to is None:
            continue
        got = [
            decode(b, TurnResult)
            for b in world.replies.get(request.reply_to, [])
            if "finish_reason" in decode_obj(b)  # not a refused request's TurnRejection
        ]
        if not any(
            r.turn_id == request.turn_id and r.session_id == request.session_id for r in got
        ):
            broken.append(f"turn {turn}: no result reached its reply_to {request.reply_to}")
    return broken


def _queues_drain(world: World, record: Record) -> list[str]:
    return [f"session {s}: turns {q} still queued" for s, q in world.memory.queues.items() if q]


def _tools_run_once(world: World, record: Record) -> list[str]:
    seen: dict[tuple[str, str, str], int] = defaultdict(int)
    for x in world.tools.executions:
        seen[x.session_id, x.turn_id, x.call_id] += 1
    return [f"tool call {k} ran {n} times" for k, n in seen.items() if n > 1]


def _sessions_apart(world: World, record: Record) -> list[str]:
    """A session's history holds only its own (and its children's) tool results, and no model
    was ever shown a forged child result."""
    broken = []
    for session, history in world.memory.histories.items():
        for m in history:
            for owner in _OWNER.findall(m.content or "") if m.role == "tool" else ():
                if owner != session and not _child_of(world, owner, session):
                    broken.append(
                        f"session {session}'s history holds session {owner}'s tool result"
                    )
    return broken


def _no_forgery(world: World, record: Record) -> list[str]:
    """No model is ever shown a child result that no child produced."""
    return [
        f"agent {agent} was given a forged child result: {m.content!r:.120}"
        for agent, request in world.model.requests
        for m in request.messages
        if m.role == "tool" and FORGED in (m.content or "")
    ]


def _child_of(world: World, child_session: str, session: str) -> bool:
    """Whether ``child_session`` is a session of a child turn of a turn of ``session``."""
    return any(
        e.type == "child.started"
        and e.session_id == session
        and getattr(e.data, "session_id", None) == child_session
        for e in world.events.events
    )


def _children_report_once(world: World, record: Record) -> list[str]:
    broken = []
    events = _by_turn(world)
    for turn, evs in events.items():
        started = {getattr(e.data, "call_id", "") for e in evs if e.type == "child.started"}
        finished: dict[str, set[str]] = defaultdict(set)
        for e in evs:
            if e.type == "child.finished":
                finished[getattr(e.data, "call_id", "")].add(e.id)
        ended = any(e.type in FINISH_TYPES for e in evs)
        for call in started:
            n = len(finished[call])
            if n > 1 or (n == 0 and not _ended_early(evs)):
                broken.append(f"turn {turn}: child of {call} reported {n} times (ended={ended})")
    # a child's tools never run after its parent's turn ended
    results = _results(world)
    for x in world.tools.executions:
        parent = _parent_of(world, x.session_id, x.turn_id)
        if parent is not None and parent in results and results[parent].completed_at < x.at:
            broken.append(f"child {x.turn_id} ran {x.tool} after its parent {parent} had ended")
    return broken


def _children_heard(world: World, record: Record) -> list[str]:
    """A child turn that ended told its parent: a worker published its ``turn.child_result``
    (the parent may have stopped waiting by then: it drops it as a copy)."""
    told = set()
    for p in world.publisher.published:
        if p.headers.get(t.H_KIND) == t.KIND_CHILD_RESULT:
            message = decode(p.body, TurnChildResult)
            told.add((message.result.session_id, message.result.turn_id))
    return [
        f"child {child} of {r.parent.turn_id} ended {r.finish_reason} and never told its parent"
        for child, r in _results(world).items()
        if r.parent is not None and child not in told
    ]


def _children_announced(world: World, record: Record) -> list[str]:
    """Every child turn that ran was announced by its parent (``child.started``)."""
    started = {
        (getattr(e.data, "session_id", ""), getattr(e.data, "turn_id", ""))
        for e in world.events.events
        if e.type == "child.started"
    }
    return [
        f"child {(e.session_id, e.turn_id)} of {e.parent_turn_id} ran unannounced"
        for e in world.events.events
        if e.type == "turn.accepted"
        and e.parent_turn_id
        and (e.session_id, e.turn_id) not in started
    ]


def _ended_early(evs: list[Event]) -> bool:
    """A parent that ended (cancelled, failed) before a child reported need not hear of it."""
    return any(e.type in ("turn.cancelled", "turn.failed") for e in evs)


def _parent_of(world: World, session: str, turn: str) -> tuple[str, str] | None:
    for e in world.events.events:
        if (
            e.type == "child.started"
            and getattr(e.data, "turn_id", None) == turn
            and getattr(e.data, "session_id", None) == session
            and e.session_id
            and e.turn_id
        ):
            return (e.session_id, e.turn_id)
    return None


def _cancels_applied(world: World, record: Record) -> list[str]:
    results = _results(world)
    return [
        f"turn {turn} was cancelled while it ran but ended {results[turn].finish_reason}"
        for turn in sorted(record.cancels)
        if turn in results and results[turn].finish_reason != "cancelled"
    ]


ROLLBACK = "rollback"
"""The reason of the schedules' cancels that ask for a rollback: a result stopped by it was
ended by such a cancel (the first cancel recorded for a turn is the one that ends it)."""


def _rollbacks_applied(world: World, record: Record) -> list[str]:
    """A turn ended by a cancel with rollback left nothing in its session's history: not its
    input, not what it added (checked for turns that started once: an id reused after the
    session's records lapsed names another turn)."""
    events = _by_turn(world)
    broken = []
    for (session, turn), result in _results(world).items():
        if result.finish_reason != "cancelled" or result.stopped_by != ROLLBACK:
            continue
        if sum(e.type == "turn.started" for e in events[session, turn]) != 1:
            continue
        question = f"question {turn}"
        if any(m.content == question for m in world.memory.histories.get(session, [])):
            broken.append(f"turn {(session, turn)} was rolled back but its input stayed")
    return broken


def _history_counted(world: World, record: Record) -> list[str]:
    """The state counts every message of its session's history (a rollback cuts both)."""
    return [
        f"session {sid}: state counts {state.history_len} messages, history holds {held}"
        for sid, state in world.memory.states.items()
        if (held := len(world.memory.histories.get(sid, []))) != state.history_len
    ]


def _approvals(world: World, record: Record) -> list[str]:
    """An approval's wait ends neither before its ``until`` nor after the turn's deadline."""
    broken = []
    requests = _first_requests(record)
    until_of: dict[tuple[str | None, str | None, str], float] = {}
    for e in world.events.events:
        call = getattr(e.data, "call_id", "")
        if e.type == "approval.requested" and getattr(e.data, "until", None) is not None:
            until_of[e.session_id, e.turn_id, call] = e.data.until  # type: ignore[union-attr]
        if e.type == "approval.decided" and getattr(e.data, "by", None) == "timeout":
            until = until_of.get((e.session_id, e.turn_id, call))
            if until is not None and e.time < until:
                broken.append(
                    f"turn {e.turn_id}: call {call} rejected by timeout {until - e.time:.1f} s"
                    " before its until"
                )
        if e.type == "approval.requested":
            until = getattr(e.data, "until", None)
            request = requests.get((e.session_id or "", e.turn_id or ""))
            if request and request.deadline and until and until > request.deadline:
                broken.append(
                    f"turn {e.turn_id} parked for approval until {until - request.deadline:.0f}"
                    " s past its deadline"
                )
    return broken


def _approved_children(world: World, record: Record) -> list[str]:
    """A sub-agent call under approval starts its child only once approved."""
    broken = []
    requests = _first_requests(record)
    for e in world.events.events:
        if e.type == "child.started" and e.turn_id:
            call = getattr(e.data, "call_id", "")
            parent = (e.session_id or "", e.turn_id)
            request = requests.get(parent)
            if request and request.agent == "boss" and (e.turn_id, call) not in record.approved:
                broken.append(f"turn {parent}: child of {call} started without an approval")
    return broken


def _first_requests(record: Record) -> dict[tuple[str, str], TurnRequest]:
    """Each turn's request as it ran: the first published (a later one with its id is a copy,
    whatever it says)."""
    first: dict[tuple[str, str], TurnRequest] = {}
    for r in record.requests:
        first.setdefault((r.session_id, r.turn_id), r)
    return first


def _decisions_applied(world: World, record: Record) -> list[str]:
    """A decision delivered while its call waited is what happened to the call (unless the turn
    was cancelled meanwhile): approved or edited, it ran (a tool, or a sub-agent's child);
    rejected, it did not."""
    broken = []
    results = _results(world)
    ran = {(x.session_id, x.turn_id, x.call_id) for x in world.tools.executions}
    ran |= {
        (e.session_id, e.turn_id, getattr(e.data, "call_id", ""))
        for e in world.events.events
        if e.type == "child.started"
    }
    first: dict[tuple[str, str, str], str] = {}
    for session, turn, call, verdict in record.decided:
        first.setdefault((session, turn, call), verdict)
    for (session, turn, call), verdict in first.items():
        result = results.get((session, turn))
        if result is None or result.finish_reason == "cancelled":
            continue
        if (verdict != "reject") != ((session, turn, call) in ran):
            broken.append(f"turn {(session, turn)}: call {call} was decided {verdict}, lost")
    return broken


def _keys_expire(world: World, record: Record) -> list[str]:
    return [f"key {k} never expires" for k in world.memory.keys.without_expiry()]


def _steps_recorded_once(world: World, record: Record) -> list[str]:
    """Every step a finished turn completed is in its step list once, in order (while the
    list lives): none appended twice by a redone save, none lost by a crash."""
    broken = []
    for (session, turn), result in _results(world).items():
        stored = world.memory.steps.get((session, turn))
        if stored is None:
            continue  # never completed a step, or expired with the session's keys
        indices = [r.step.index for r in stored]
        if indices != list(range(result.steps)):
            broken.append(f"turn {(session, turn)}: {result.steps} steps, recorded {indices}")
    return broken


def _daily_spend(world: World, record: Record) -> list[str]:
    """Every model call counts once in the agents' days: what the days hold is what the turns
    of agents with a daily budget spent themselves (a turn's usage less what its children
    reported to it)."""
    counted = sum(s.total_tokens for s in world.memory.spend.values())
    reported: dict[tuple[str, str], int] = defaultdict(int)
    for e in world.events.events:
        if e.type == "child.finished" and e.session_id and e.turn_id:
            usage = getattr(e.data, "usage", None)
            reported[e.session_id, e.turn_id] += usage.total_tokens if usage else 0
    own = sum(
        r.usage.total_tokens - reported[turn]
        for turn, r in _results(world).items()
        if r.agent in DAILY
    )
    if counted > own:  # (a worker that dies between a turn's end and its count counts less)
        return [f"the agents' daily spend counts {counted} tokens, their turns spent {own}"]
    return []


def _rejections(world: World, record: Record) -> list[str]:
    """A turn announced rejected was never accepted, and one turn id is one session's as long
    as its session index lives (twice the idle lifetime past the turn's last activity: after
    that another session may take the id, as documented)."""
    broken = []
    accepted = _accepted(world)
    for e in world.events.events:
        if e.type == "turn.rejected" and (e.session_id, e.turn_id) in accepted:
            broken.append(f"turn {(e.session_id, e.turn_id)} was accepted, then announced rejected")
    owners: dict[str, set[str]] = defaultdict(set)
    for session, turn in accepted:
        owners[turn].add(session)
    events = _by_turn(world)
    for turn, sessions in owners.items():
        if len(sessions) < 2:
            continue
        # by what the turns did (an accept's event carries the store's wall clock)
        times = {
            s: [e.time for e in events[s, turn] if e.type != "turn.accepted"] for s in sessions
        }
        spans = sorted((min(times[s]), max(times[s]), s) for s in sessions if times[s])
        for (_, last, first), (taken, _, second) in pairwise(spans):
            if taken < last + 2 * SESSION_TTL_S:
                broken.append(f"turn id {turn} was accepted in sessions {[first, second]}")
    return broken


def _tenant_cap(world: World, record: Record) -> list[str]:
    """The tenant's cap on running turns holds: never more than ``CAP`` root turns between
    their start and their end, in the order the events went out (a slot is taken before a
    turn's start is announced, and given back after its end is); and no slot or place in
    line is left once the world has settled."""
    running: set[tuple[str | None, str | None]] = set()
    started: set[tuple[str | None, str | None]] = set()
    ended: set[tuple[str | None, str | None]] = set()
    broken = []
    for e in world.events.events:
        turn = (e.session_id, e.turn_id)
        if e.parent_turn_id is not None:
            continue
        if e.type == "turn.started" and turn not in started:
            started.add(turn)
            running.add(turn)
            if len(running) > CAP:
                broken.append(f"{len(running)} turns ran at once, over the cap: {sorted(running)}")
        elif e.type in FINISH_TYPES and turn not in ended:
            ended.add(turn)
            running.discard(turn)
    for tenant, slots in world.slots.tenants.items():
        if slots.running or slots.line or slots.sessions or slots.starting:
            broken.append(
                f"tenant {tenant}: slots left after every turn ended: running {slots.running}, "
                f"line {slots.line}, starting {slots.starting}"
            )
    return broken


CHECKS = _checks()
