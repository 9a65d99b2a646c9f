"""The session port's contract, run against both stores: the Redis store (real Redis) and the
in-memory one the unit tests use, so the double cannot drift from the real thing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from contracts import keys
from contracts.control import ApprovalRequest, TurnCancel, TurnDecision
from contracts.messages import ChatMessage, ToolCall
from contracts.state import (
    AgentStep,
    ModelResponse,
    PendingStep,
    Spend,
    StepExecution,
    ToolExecution,
)
from contracts.turns import InputMessage, TurnError, TurnRequest
from worker.errors import StaleStateError
from worker.loop.approvals import parked
from worker.loop.turn import closed, new_execution, turn_result, with_execution, with_step
from worker.profiles.agents import AgentProfile
from worker.session.history_cache import HistoryCache
from worker.session.port import SessionStore, StepSession
from worker.session.store import RedisStore
from worker.testing.memory import MemoryStore

LEASE_TTL_S = 0.4
AGENT = AgentProfile(name="support")


@pytest.fixture(params=["redis", "redis-copies", "memory"])
async def store(request: pytest.FixtureRequest, redis: Redis) -> AsyncIterator[SessionStore]:
    if request.param == "redis":
        yield RedisStore(redis, lease_ttl_s=LEASE_TTL_S)
    elif request.param == "redis-copies":  # every history copied, however short
        yield RedisStore(redis, lease_ttl_s=LEASE_TTL_S, history_cache=HistoryCache(1 << 30, 0))
    else:
        yield MemoryStore(lease_ttl_s=LEASE_TTL_S)


def turn(uid: str, n: int = 1, *, persist: bool = True, reply_to: str | None = None) -> TurnRequest:
    return TurnRequest(
        turn_id=f"t-{uid}-{n}",
        session_id=f"s-{uid}",
        agent="support",
        input=(InputMessage(content=f"question {n}"),),
        persist=persist,
        reply_to=reply_to,
    )


async def take(store: SessionStore, session_id: str) -> StepSession:
    session = await store.take(session_id)
    assert session is not None, "the lease should be free"
    return session


async def finish(session: StepSession, request: TurnRequest, content: str = "done") -> None:
    """Run ``request`` as a one-save turn and store its result."""
    state = new_execution(session.take_state(), request, AGENT, time.time())
    inputs = [m.to_chat() for m in request.input]
    state = await session.save(state, append=inputs)
    answer = ChatMessage(role="assistant", content=content)
    result = turn_result(state, "stop", content, None, time.time())
    appended = 2 if request.persist else 0
    final = closed(state, appended=appended, now=time.time())
    await session.save(final, append=[answer] if request.persist else (), result=result)


async def test_accept_queues_turns_in_arrival_order_once_each(
    store: SessionStore, uid: str
) -> None:
    first, second = turn(uid, 1), turn(uid, 2)
    assert (await store.accept(first)).status == "start"
    queued = await store.accept(second)
    assert (queued.status, queued.ahead) == ("queued", 1)
    assert (await store.accept(first)).status == "pending"
    assert await store.head(f"s-{uid}") == first.turn_id
    assert await store.request(f"s-{uid}", second.turn_id) == second


async def test_a_session_being_erased_accepts_no_turn_while_the_erasure_holds_it(
    store: SessionStore, redis: Redis, uid: str
) -> None:
    request = turn(uid, 1)
    eraser = await take(store, request.session_id)
    if isinstance(store, MemoryStore):
        store.erasing[request.session_id] = eraser.token
    else:
        await redis.set(keys.session_erasing(request.session_id), eraser.token, px=60_000)
    assert (await store.accept(request)).status == "erasing"
    assert await store.head(request.session_id) is None
    assert await store.request(request.session_id, request.turn_id) is None
    # an erasure whose lease is gone (its worker died) holds nothing back
    await store.release(eraser)
    assert (await store.accept(request)).status == "start"


async def test_a_finished_turn_names_the_next_and_is_answered_from_its_result(
    store: SessionStore, uid: str
) -> None:
    first, second = turn(uid, 1, reply_to="replies-x"), turn(uid, 2)
    await store.accept(first)
    await store.accept(second)
    session = await take(store, f"s-{uid}")
    await finish(session, first)
    assert session.released
    assert session.next_turn == second.turn_id
    assert await store.head(f"s-{uid}") == second.turn_id
    assert await store.request(f"s-{uid}", first.turn_id) is None
    assert await store.reply_to(f"s-{uid}", first.turn_id) == ("replies-x",)
    stored = await store.result(f"s-{uid}", first.turn_id)
    assert stored is not None and stored.content == "done"
    again = await store.accept(first)
    assert (again.status, again.result) == ("done", stored)


async def test_one_lease_at_a_time_with_increasing_tokens(store: SessionStore, uid: str) -> None:
    session = await take(store, f"s-{uid}")
    assert await store.take(f"s-{uid}") is None
    assert await store.renew(session) == "held"
    await store.release(session)
    after = await take(store, f"s-{uid}")
    assert after.token > session.token
    assert await store.renew(session) == "lost", "a released lease is not renewed"
    await store.release(after)


async def test_a_save_under_a_lost_lease_fails(store: SessionStore, uid: str) -> None:
    await store.accept(turn(uid))
    stale = await take(store, f"s-{uid}")
    state = new_execution(stale.take_state(), turn(uid), AGENT, time.time())
    await asyncio.sleep(LEASE_TTL_S * 1.5)  # expired: another worker takes the session
    newer = await take(store, f"s-{uid}")
    assert await store.renew(stale) == "lost"
    with pytest.raises(StaleStateError):
        await stale.save(state)
    await store.release(newer)


async def test_a_save_on_an_old_version_fails(store: SessionStore, uid: str) -> None:
    await store.accept(turn(uid))
    session = await take(store, f"s-{uid}")
    state = new_execution(session.take_state(), turn(uid), AGENT, time.time())
    saved = await session.save(state)
    assert saved.version == state.version + 1
    with pytest.raises(StaleStateError):
        await session.save(state)  # written since it was loaded
    await store.release(session)


async def test_the_next_step_reads_the_state_and_the_conversation(
    store: SessionStore, uid: str
) -> None:
    request = turn(uid)
    await store.accept(request)
    session = await take(store, f"s-{uid}")
    assert session.take_state() is None  # a new session
    state = new_execution(None, request, AGENT, time.time())
    saved = await session.save(state, append=[m.to_chat() for m in request.input], release=True)
    assert session.released
    following = await take(store, f"s-{uid}")
    read = following.take_state()
    assert read == saved
    assert following.take_state() is None, "handed out once"
    assert [m.content for m in await following.load_messages(read)] == ["question 1"]
    parked = following.park(read)
    assert parked.unpark() == read  # the version included
    await store.release(following)


async def test_a_persist_false_turn_leaves_the_history_as_it_was(
    store: SessionStore, uid: str
) -> None:
    kept, transient = turn(uid, 1), turn(uid, 2, persist=False)
    await store.accept(kept)
    await store.accept(transient)
    session = await take(store, f"s-{uid}")
    await finish(session, kept, "kept answer")
    session = await take(store, f"s-{uid}")
    state = new_execution(session.take_state(), transient, AGENT, time.time())
    state = await session.save(state, append=[m.to_chat() for m in transient.input])
    seen = [m.content for m in await session.load_messages(state)]
    assert seen == ["question 1", "kept answer", "question 2"]
    ex = state.execution
    assert ex is not None
    error = TurnError(code="x", message="y")
    result = turn_result(state, "error", None, error, time.time())
    await session.save(closed(state, appended=0, now=time.time()), result=result)
    after = await take(store, f"s-{uid}")
    read = after.take_state()
    assert read is not None and read.execution is None
    assert [m.content for m in await after.load_messages(read)] == ["question 1", "kept answer"]
    await store.release(after)


@pytest.mark.parametrize("earlier", [0, 1])
async def test_a_result_saved_with_cut_to_cuts_the_history_back_in_the_same_write(
    store: SessionStore, uid: str, earlier: int
) -> None:
    """A cancel with rollback: the turn's messages go in the save that ends it (cut back to
    nothing when the turn was the session's first)."""
    requests = [turn(uid, n) for n in range(1, earlier + 2)]
    for request in requests:
        await store.accept(request)
    for request in requests[:-1]:
        await finish(await take(store, f"s-{uid}"), request, "kept answer")
    rolled = requests[-1]
    session = await take(store, f"s-{uid}")
    state = new_execution(session.take_state(), rolled, AGENT, time.time())
    start = state.history_len
    state = await session.save(state, append=[m.to_chat() for m in rolled.input])
    state = await session.save(state, append=[ChatMessage(role="assistant", content="half")])
    result = turn_result(state, "cancelled", "half", None, time.time())
    final = closed(state, appended=0, now=time.time()).model_copy(update={"history_len": start})
    await session.save(final, result=result, cut_to=start)
    after = await take(store, f"s-{uid}")
    read = after.take_state()
    assert read is not None and read.history_len == start == 2 * earlier
    kept = [m.content for m in await after.load_messages(read)]
    assert kept == ["question 1", "kept answer"][: 2 * earlier]
    assert await store.result(f"s-{uid}", rolled.turn_id) == result
    await store.release(after)


async def test_a_copy_published_while_the_turn_runs_is_answered_too(
    store: SessionStore, uid: str
) -> None:
    first = turn(uid, 1, reply_to="replies-a")
    await store.accept(first)
    for reply_to in ("replies-b", "replies-a", None):  # a copy; the first again; no reply wanted
        copy = first.model_copy(update={"reply_to": reply_to})
        assert (await store.accept(copy)).status == "pending"
    session = await take(store, f"s-{uid}")
    await finish(session, first)
    assert session.replies == ("replies-a", "replies-b")
    assert await store.reply_to(f"s-{uid}", first.turn_id) == ("replies-a", "replies-b")


async def test_a_copy_of_a_turn_carries_the_time_the_first_was_accepted(
    store: SessionStore, uid: str
) -> None:
    first = await store.accept(turn(uid, 1))
    await asyncio.sleep(0.05)
    copy = await store.accept(turn(uid, 1))
    behind = await store.accept(turn(uid, 2))
    assert first.accepted_at is not None
    assert copy.accepted_at == first.accepted_at
    assert behind.accepted_at is not None and behind.accepted_at > first.accepted_at


# -- a turn id belongs to one session -----------------------------------------------------------


@pytest.fixture(params=["redis", "redis as on a cluster", "memory"])
async def accepting(request: pytest.FixtureRequest, redis: Redis) -> AsyncIterator[SessionStore]:
    """The stores, and the Redis store taking its Redis Cluster path (the turn's session index
    claimed by a script of its own before the accept) on the one Redis."""
    if request.param == "memory":
        yield MemoryStore(lease_ttl_s=LEASE_TTL_S)
        return
    store = RedisStore(redis, lease_ttl_s=LEASE_TTL_S)
    store.cluster = request.param != "redis"
    yield store


def in_session(request: TurnRequest, session_id: str) -> TurnRequest:
    return request.model_copy(update={"session_id": session_id})


async def test_a_turn_id_another_session_accepted_is_refused_and_records_nothing(
    accepting: SessionStore, uid: str
) -> None:
    store = accepting
    mine = turn(uid, 1, reply_to="replies-a")
    theirs = in_session(mine, f"s-{uid}-b").model_copy(update={"reply_to": "replies-b"})
    assert (await store.accept(mine)).status == "start"
    assert (await store.accept(theirs)).status == "in_use"
    assert await store.head(theirs.session_id) is None
    assert await store.request(theirs.session_id, mine.turn_id) is None
    assert await store.session_of(mine.turn_id) == mine.session_id
    assert (await store.accept(mine)).status == "pending", "the first session's copy is a copy"
    session = await take(store, mine.session_id)
    await finish(session, mine)
    assert session.replies == ("replies-a",), "the refused request named no reply queue"
    assert (await store.accept(theirs)).status == "in_use", "also once the turn has finished"
    assert await store.result(theirs.session_id, mine.turn_id) is None


async def test_sessions_racing_on_one_turn_id_cannot_both_win(
    accepting: SessionStore, uid: str
) -> None:
    requests = [in_session(turn(uid, 1), f"s-{uid}-{n}") for n in range(8)]
    accepted = await asyncio.gather(*(accepting.accept(r) for r in requests))
    statuses = [a.status for a in accepted]
    assert sorted(statuses) == ["in_use"] * 7 + ["start"]
    winner = requests[statuses.index("start")].session_id
    assert await accepting.session_of(requests[0].turn_id) == winner
    for r in requests:
        assert await accepting.head(r.session_id) == (r.turn_id if r.session_id == winner else None)


# -- cancel ------------------------------------------------------------------------------------


def cancel_of(request: TurnRequest, reason: str = "user left") -> TurnCancel:
    return TurnCancel(turn_id=request.turn_id, session_id=request.session_id, reason=reason)


async def record_cancel(
    store: SessionStore, request: TurnRequest, reason: str = "user left"
) -> str:
    recorded = await store.record_control(
        request.session_id, request.turn_id, "cancel", cancel_of(request, reason)
    )
    return recorded.status


async def test_a_cancel_is_recorded_once_and_read_with_the_lease_and_the_renewal(
    store: SessionStore, uid: str
) -> None:
    first = turn(uid, 1)
    assert await record_cancel(store, first) == "unknown"
    await store.accept(first)
    assert await store.session_of(first.turn_id) == first.session_id
    assert await store.session_of(f"t-{uid}-none") is None
    plain = await store.take(first.session_id, first.turn_id)
    assert plain is not None and plain.cancel is None
    assert await record_cancel(store, first) == "recorded"
    assert await store.renew(plain) == "cancelled"  # a step running now is told
    await store.release(plain)
    assert await record_cancel(store, first, "again") == "again"
    session = await store.take(first.session_id, first.turn_id)
    assert session is not None and session.cancel == cancel_of(first)  # the first one counts
    await finish(session, first)
    assert await record_cancel(store, first) == "finished"
    # the turn's controls went with it: the session's next turn is not cancelled
    second = turn(uid, 2)
    await store.accept(second)
    after = await store.take(second.session_id, second.turn_id)
    assert after is not None and after.cancel is None
    assert await store.renew(after) == "held"


async def test_a_save_reads_a_cancel_recorded_while_the_step_ran(
    store: SessionStore, uid: str
) -> None:
    first = turn(uid, 1)
    await store.accept(first)
    session = await take_for(store, first)
    state = new_execution(session.take_state(), first, AGENT, time.time())
    state = await session.save(state, append=[m.to_chat() for m in first.input])
    assert session.cancel is None and not session.cancelled()
    assert await record_cancel(store, first) == "recorded"
    await session.save(state)
    assert session.cancel == cancel_of(first) and session.cancelled()


async def take_for(store: SessionStore, request: TurnRequest) -> StepSession:
    session = await store.take(request.session_id, request.turn_id)
    assert session is not None, "the lease should be free"
    return session


async def test_a_queued_turn_is_ended_in_place_and_the_running_one_is_not(
    store: SessionStore, uid: str
) -> None:
    running, queued, last = turn(uid, 1), turn(uid, 2, reply_to="r.a"), turn(uid, 3)
    for request in (running, queued, last):
        await store.accept(request)
    await store.accept(queued.model_copy(update={"reply_to": "r.b"}))
    state = new_execution(None, queued, AGENT, time.time())
    result = turn_result(state, "cancelled", None, None, time.time())

    assert await store.end_queued(running.session_id, running.turn_id, result) == ("head", ())
    assert await store.end_queued(queued.session_id, queued.turn_id, result) == (
        "ended",
        ("r.a", "r.b"),
    )
    assert await store.end_queued(queued.session_id, queued.turn_id, result) == ("finished", ())
    assert await store.result(queued.session_id, queued.turn_id) == result
    assert await store.request(queued.session_id, queued.turn_id) is None
    session = await take(store, running.session_id)
    await finish(session, running)
    assert session.next_turn == last.turn_id  # the ended turn is no longer in the queue


async def test_a_parked_turn_is_found_by_its_controls_until_it_goes_on(
    store: SessionStore, uid: str
) -> None:
    request = turn(uid)
    await store.accept(request)
    session = await take(store, request.session_id)
    session.turn_id = request.turn_id
    state = new_execution(session.take_state(), request, AGENT, time.time())
    state = await session.save(state, append=[m.to_chat() for m in request.input])
    call = ToolCall(id="call_1", name="refund", arguments="{}")
    answer = ModelResponse(message=ChatMessage(role="assistant", tool_calls=(call,)))
    pending = PendingStep(index=0, started_at=time.time(), response=answer)
    state = await session.save(with_execution(state, pending=pending))
    decision = TurnDecision(turn_id=request.turn_id, call_id="call_1", decision="approve")
    early = await store.record_control(
        request.session_id, request.turn_id, "decision:call_1", decision
    )
    assert (early.status, early.parked) == ("recorded", None)  # not parked yet

    state = await session.save(parked(state, ("call_1",), time.time(), 60), release=True)
    assert session.controls_waiting, "a decision recorded while it parked wakes it at once"
    again = await store.record_control(
        request.session_id, request.turn_id, "decision:call_1", decision
    )
    assert (again.status, again.parked) == ("again", 0)
    resumed = await store.take(request.session_id, request.turn_id)
    assert resumed is not None
    assert resumed.parked == 0 and resumed.decisions == {"call_1": decision}
    state = resumed.take_state() or state
    await resumed.save(with_execution(state, status="in_progress", wait=None), release=True)
    later = await store.record_control(
        request.session_id, request.turn_id, "decision:call_2", decision
    )
    assert (later.status, later.parked) == ("recorded", None)


async def test_a_call_waiting_for_approval_is_listed_until_its_wait_ends(
    store: SessionStore, uid: str, redis: Redis
) -> None:
    turn_id, now = f"t-{uid}", time.time()
    key = keys.approvals_waiting()
    if isinstance(store, RedisStore):
        await redis.persist(key)  # as an earlier version left it: no expiry

    def waiting(call_id: str, until: float) -> ApprovalRequest:
        return ApprovalRequest(
            turn_id=turn_id,
            session_id=f"s-{uid}",
            agent="support",
            call_id=call_id,
            tool="refund",
            arguments="{}",
            since=now,
            until=until,
        )

    async def mine() -> list[str]:
        return [r.call_id for r in await store.approvals() if r.turn_id == turn_id]

    await store.note_approvals([waiting("c1", now + 60), waiting("c2", now - 1)])

    assert await mine() == ["c1"]  # c2's wait has ended: it is not listed
    if isinstance(store, RedisStore):
        assert await redis.ttl(key) > 0, "the list expires"
        assert not await redis.hexists(key, f"{turn_id}:c2"), "an ended wait's entry is gone"
    await store.clear_approvals(turn_id, ["c1"])
    assert await mine() == []


async def test_an_agents_spend_is_summed_per_day(store: SessionStore, uid: str) -> None:
    agent = f"agent-{uid}"
    first = Spend(total_tokens=10, cost_usd=0.25, tool_calls=2, wall_s=1.5)
    await store.add_spent(agent, first)
    await store.add_spent(agent, first)
    fresh = RedisStore(store.redis) if isinstance(store, RedisStore) else store
    try:
        assert await fresh.spent_today(agent) == first + first
        assert await fresh.spent_today(f"other-{uid}") == Spend()
    finally:
        if isinstance(store, RedisStore):
            async for key in store.redis.scan_iter(match=f"lw:spend:agent-{uid}:*"):
                await store.redis.delete(key)


async def test_a_turns_first_step_reads_the_queue_head_and_its_request_with_the_lease(
    store: SessionStore, uid: str
) -> None:
    first, second = turn(uid, 1), turn(uid, 2)
    await store.accept(first)
    await store.accept(second)
    plain = await store.take(first.session_id, first.turn_id)
    assert plain is not None and plain.opening is None  # only asked for a first step
    await store.release(plain)
    session = await store.take(first.session_id, first.turn_id, first=True)
    assert session is not None and session.opening is not None
    assert session.opening.head == first.turn_id
    assert session.opening.request == first
    await finish(session, first)
    # the second turn is the head now; a turn never accepted has no request
    session = await store.take(second.session_id, f"t-{uid}-never", first=True)
    assert session is not None and session.opening is not None
    assert session.opening.head == second.turn_id and session.opening.request is None
    await store.release(session)
    await finish_head(store, second)
    empty = await store.take(second.session_id, second.turn_id, first=True)
    assert empty is not None and empty.opening is not None
    assert empty.opening.head is None and empty.opening.request is None  # it ended
    await store.release(empty)


async def finish_head(store: SessionStore, request: TurnRequest) -> None:
    session = await store.take(request.session_id, request.turn_id)
    assert session is not None
    await finish(session, request)


async def expiries(store: SessionStore, redis: Redis, session_id: str) -> dict[str, int]:
    """Every key of the session, by its name after the hash tag, and how many whole seconds it
    has left (-1: no expiry) — read from Redis, or from the memory store's keyspace."""
    if isinstance(store, MemoryStore):
        now = store.clock()
        tag = f"lw:{{{session_id}}}:"
        return {
            k.removeprefix(tag): -1 if at is None else round(at - now)
            for k, at in store.keys.expires.items()
            if k.startswith(tag)
        }
    found: dict[str, int] = {}
    async for key in redis.scan_iter(match=f"lw:{{{session_id}}}:*"):
        found[key.decode().split("}:", 1)[1]] = int(await redis.ttl(key))
    return found


async def test_every_key_of_a_session_expires_as_its_turns_go(
    store: SessionStore, redis: Redis, uid: str
) -> None:
    """What the simulation relies on: both stores give a session's keys the same expiry at
    each point of a turn (the idle lifetime from its first save on, reset by its end)."""
    ttl = 3600
    store.ttl_s = ttl  # type: ignore[attr-defined]
    first, second = turn(uid, 1), turn(uid, 2)
    await store.accept(first)
    session = await take(store, first.session_id)
    state = new_execution(session.take_state(), first, AGENT, time.time())
    state = await session.save(state, append=[m.to_chat() for m in first.input])
    running = await expiries(store, redis, first.session_id)
    assert {"state", "history", "fence", "turns", "queue", "requests"} <= set(running)
    assert all(ttl - 5 <= s <= ttl for k, s in running.items() if k != "lease"), running
    await store.accept(second)  # queued behind the running one
    answer = ChatMessage(role="assistant", content="done")
    result = turn_result(state, "stop", "done", None, time.time())
    final = closed(state, appended=2, now=time.time())
    await session.save(final, append=[answer], result=result)
    ended = await expiries(store, redis, first.session_id)
    assert {k for k in ended} >= {
        "state",
        "history",
        "turns",
        "queue",
        f"turn:{first.turn_id}:result",
    }
    assert all(ttl - 5 <= s <= ttl for s in ended.values()), ended


async def test_a_steps_record_is_written_once_beside_the_state(
    store: SessionStore, redis: Redis, uid: str
) -> None:
    """The save that completes a step appends its record to the turn's step list, once (a
    stale copy of that save is refused whole); the state keeps its count, not the record; the
    record keeps the calls' metadata, not the results the history holds."""
    ttl = 3600
    store.ttl_s = ttl  # type: ignore[attr-defined]
    request = turn(uid)
    await store.accept(request)
    session = await take(store, request.session_id)
    state = new_execution(session.take_state(), request, AGENT, time.time())
    state = await session.save(state, append=[m.to_chat() for m in request.input])
    call = ChatMessage(role="assistant", tool_calls=(ToolCall(id="c1", name="search"),))
    result = ChatMessage.tool("c1", '{"items": ["a"]}')
    now = time.time()
    execution = ToolExecution(
        call_id="c1",
        name="search",
        arguments={"q": "a"},
        outcome="ok",
        value={"items": ["a"]},
        content='{"items": ["a"]}',
        started_at=now,
        completed_at=now,
    )
    record = StepExecution(
        step=AgentStep(
            index=0,
            input_count=2,
            output_messages=(call, result),
            response=ModelResponse(message=call, finish_reason="tool_calls", model="m1"),
            tool_executions=(execution,),
        ),
        started_at=now,
        completed_at=now,
    )
    counted = with_step(state, record, pending=None)
    saved = await session.save(counted, append=[result], step=record)
    with pytest.raises(StaleStateError):  # a worker that missed that save does it again
        await session.save(counted, append=[result], step=record)

    steps = await session.load_steps(saved)
    assert [r.step.index for r in steps] == [0]
    kept = steps[0].step.tool_executions[0]
    assert (kept.call_id, kept.outcome, kept.arguments) == ("c1", "ok", {"q": "a"})
    assert (kept.content, kept.value, steps[0].step.output_messages) == ("", None, ())
    stored = await store.stored_state(request.session_id)
    assert stored is not None and stored.execution is not None
    ex = stored.execution
    assert (ex.step_count, ex.tool_calls, ex.steps) == (1, 1, ())
    assert [(r.model, r.steps) for r in ex.models] == [("m1", 1)]
    lives = await expiries(store, redis, request.session_id)
    assert ttl - 5 <= lives[f"turn:{request.turn_id}:steps"] <= ttl, lives


async def test_a_workflow_rounds_record_is_read_back_whatever_its_size_and_depth(
    store: SessionStore, uid: str
) -> None:
    """A workflow round keeps its nodes' answers (in no history): records the worker wrote are
    read back without the limits on messages from outside (4 MiB, 32 levels)."""
    request = turn(uid)
    await store.accept(request)
    session = await take(store, request.session_id)
    state = new_execution(session.take_state(), request, AGENT, time.time())
    state = await session.save(state, append=[m.to_chat() for m in request.input])
    deep: Any = {"leaf": "x"}
    for _ in range(40):
        deep = {"in": deep}
    now = time.time()
    answers = tuple(
        ToolExecution(
            call_id=f"node_{i}",
            name="writer",
            outcome="ok",
            value={"text": "y" * 1_500_000, "deep": deep},
            content="y" * 1000,
            started_at=now,
            completed_at=now,
        )
        for i in range(3)
    )
    call = ChatMessage(
        role="assistant", tool_calls=tuple(ToolCall(id=a.call_id, name="writer") for a in answers)
    )
    record = StepExecution(
        step=AgentStep(
            index=0,
            input_count=0,
            response=ModelResponse(message=call, finish_reason="tool_calls"),
            tool_executions=answers,
        ),
        started_at=now,
        completed_at=now,
    )
    saved = await session.save(with_step(state, record, pending=None), step=record)
    steps = await session.load_steps(saved)
    assert len(steps) == 1
    kept = steps[0].step.tool_executions
    assert [len(e.value["text"]) for e in kept] == [1_500_000] * 3
    assert kept[0].value["deep"] == deep
