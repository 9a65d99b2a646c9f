"""Expiry of a session's keys in the Redis store: every key of a live turn outlives it, and
every key of the session expires ``ttl_s`` after the session's last activity."""

from __future__ import annotations

import time

import pytest
from redis.asyncio import Redis

from contracts import keys
from contracts.control import TurnDecision
from contracts.messages import ChatMessage, ToolCall
from contracts.state import AgentState, ModelResponse, PendingStep
from contracts.turns import InputMessage, TurnRequest
from worker.errors import StaleStateError
from worker.loop.approvals import parked
from worker.loop.turn import closed, new_execution, turn_result, with_execution
from worker.profiles.agents import AgentProfile
from worker.session.port import StepSession
from worker.session.records import SessionRecords
from worker.session.store import RedisStore

TTL_S = 120
AGENT = AgentProfile(name="support")


def turn(uid: str, n: int = 1, *, persist: bool = True) -> TurnRequest:
    return TurnRequest(
        turn_id=f"t-{uid}-{n}",
        session_id=f"s-{uid}",
        agent="support",
        input=(InputMessage(content=f"question {n}"),),
        persist=persist,
    )


async def ttls(redis: Redis, session_id: str) -> dict[str, int]:
    """Every key of the session (its hash tag), with its TTL in seconds (-1: none)."""
    found: dict[str, int] = {}
    async for key in redis.scan_iter(match=f"lw:{{{session_id}}}:*"):
        name = key.decode()
        found[name.split("}:", 1)[1]] = int(await redis.ttl(key))
    return found


async def doom(redis: Redis, session_id: str, ms: int = 2000) -> None:
    """Let every key of the session have ``ms`` left to live (but the results of turns that
    ended: each lives ``ttl_s`` after its turn's end)."""
    async for key in redis.scan_iter(match=f"lw:{{{session_id}}}:*"):
        if not key.endswith(b":result"):
            await redis.pexpire(key, ms)


def lasting(found: dict[str, int], at_least: int) -> dict[str, int]:
    """The keys that live less than ``at_least`` seconds more (or for ever)."""
    return {k: t for k, t in found.items() if k != "lease" and not 0 < at_least <= t}


async def take(store: RedisStore, request: TurnRequest) -> StepSession:
    session = await store.take(request.session_id, request.turn_id)
    assert session is not None
    return session


async def first_save(store: RedisStore, request: TurnRequest) -> tuple[StepSession, AgentState]:
    await store.accept(request)
    session = await take(store, request)
    state = new_execution(session.take_state(), request, AGENT, time.time())
    state = await session.save(state, append=[m.to_chat() for m in request.input])
    return session, state


async def end(session: StepSession, state: AgentState, appended: int) -> None:
    result = turn_result(state, "stop", "done", None, time.time())
    answer = ChatMessage(role="assistant", content="done")
    final = closed(state, appended=appended, now=time.time())
    await session.save(final, append=[answer], result=result)


async def test_every_key_of_a_new_session_expires_from_its_first_save(
    redis: Redis, uid: str
) -> None:
    store = RedisStore(redis, ttl_s=TTL_S)
    request = turn(uid)
    session, state = await first_save(store, request)
    found = await ttls(redis, request.session_id)
    assert {"state", "history", "fence", "turns", "queue", "requests"} <= set(found)
    assert lasting(found, TTL_S - 5) == {}
    await end(session, state, 2)
    found = await ttls(redis, request.session_id)
    assert f"turn:{request.turn_id}:result" in found
    assert lasting(found, TTL_S - 5) == {}
    assert all(t <= TTL_S for t in found.values()), "the idle lifetime counts from the end"


async def test_a_turn_that_starts_as_its_session_expires_keeps_its_keys(
    redis: Redis, uid: str
) -> None:
    store = RedisStore(redis, ttl_s=TTL_S)
    first, second = turn(uid, 1), turn(uid, 2)
    session, state = await first_save(store, first)
    await end(session, state, 2)
    await store.accept(second)
    await doom(redis, first.session_id)  # the idle lifetime is almost over
    session = await take(store, second)
    assert lasting(await ttls(redis, first.session_id), TTL_S - 5) == {}, "renewed with the lease"
    state = new_execution(session.take_state(), second, AGENT, time.time())
    state = await session.save(state, append=[m.to_chat() for m in second.input])
    await doom(redis, first.session_id)  # a step that outlasts what was left
    assert await store.renew(session) == "held"
    assert lasting(await ttls(redis, first.session_id), TTL_S - 5) == {}, "renewed with it"
    await doom(redis, first.session_id)
    call = ToolCall(id="call_1", name="lookup", arguments="{}")
    answer = ModelResponse(message=ChatMessage(role="assistant", tool_calls=(call,)))
    pending = PendingStep(index=0, started_at=time.time(), response=answer)
    state = await session.save(with_execution(state, pending=pending))
    assert lasting(await ttls(redis, first.session_id), TTL_S - 5) == {}, "renewed by a save"
    await end(session, state, 2)
    history = await store.history(first.session_id)
    assert [m.content for m in history] == ["question 1", "done", "question 2", "done"]


async def test_a_parked_turns_keys_outlive_its_wait(redis: Redis, uid: str) -> None:
    store = RedisStore(redis, ttl_s=TTL_S)
    request, behind = turn(uid, 1), turn(uid, 2)
    session, state = await first_save(store, request)
    call = ToolCall(id="call_1", name="refund", arguments="{}")
    answer = ModelResponse(message=ChatMessage(role="assistant", tool_calls=(call,)))
    pending = PendingStep(index=0, started_at=time.time(), response=answer)
    state = await session.save(with_execution(state, pending=pending))
    wait_s = 3600  # the approval may come an hour later: longer than the idle lifetime
    state = await session.save(parked(state, ("call_1",), time.time(), wait_s), release=True)
    found = await ttls(redis, request.session_id)
    assert "turn:" + request.turn_id + ":controls" in found
    assert lasting(found, TTL_S + wait_s - 5) == {}
    index = keys.turn_session(request.turn_id)  # a cancel naming the turn alone finds it
    assert TTL_S + wait_s - 5 <= await redis.ttl(index)
    # what happens while it waits does not shorten that
    await store.accept(behind)
    decision = TurnDecision(turn_id=request.turn_id, call_id="call_1", decision="approve")
    recorded = await store.record_control(
        request.session_id, request.turn_id, "decision:call_1", decision
    )
    assert recorded.status == "recorded"
    assert lasting(await ttls(redis, request.session_id), TTL_S + wait_s - 5) == {}
    resumed = await take(store, request)
    assert resumed.decisions == {"call_1": decision}
    state = resumed.take_state() or state
    state = await resumed.save(with_execution(state, status="in_progress", wait=None))
    await end(resumed, state, 3)
    found = await ttls(redis, request.session_id)
    assert lasting(found, TTL_S - 5) == {}
    assert all(t <= TTL_S for t in found.values()), "its end sets the idle lifetime"
    # the index outlives every key of its turn: twice their lifetime
    assert 2 * TTL_S - 5 <= await redis.ttl(index) <= 2 * TTL_S


async def test_a_parked_persist_false_turn_keeps_the_sessions_history(
    redis: Redis, uid: str
) -> None:
    store = RedisStore(redis, ttl_s=TTL_S)
    kept, transient = turn(uid, 1), turn(uid, 2, persist=False)
    session, state = await first_save(store, kept)
    await end(session, state, 2)
    session, state = await first_save(store, transient)  # its messages go to a list of its own
    wait_s = 3600
    state = await session.save(parked(state, (), time.time(), wait_s), release=True)
    found = await ttls(redis, kept.session_id)
    assert {"history", f"turn:{transient.turn_id}:messages"} <= set(found)
    del found[f"turn:{kept.turn_id}:result"]  # lives ttl_s after its own turn's end
    assert lasting(found, TTL_S + wait_s - 5) == {}


async def test_erasing_a_session_never_lets_its_fencing_tokens_go_back(
    redis: Redis, uid: str
) -> None:
    store = RedisStore(redis, ttl_s=TTL_S)
    request = turn(uid, 1)
    await store.accept(request)
    stale = await take(store, request)  # a worker whose step hangs
    state = new_execution(stale.take_state(), request, AGENT, time.time())
    await redis.delete(keys.session_lease(request.session_id))  # its lease expired
    eraser = await take(store, request)
    # the deletion cancelled the session's turns first: none is queued when it erases
    await redis.delete(keys.session_queue(request.session_id))
    erased = await SessionRecords(redis).erase(request.session_id, eraser.token)
    assert erased is not None and erased.deleted > 0
    eraser.released = True
    found = await ttls(redis, request.session_id)
    assert set(found) == {"fence"} and 0 < found["fence"] <= TTL_S, "a bare counter, expiring"
    # the session is started again under the same id, its turn taken by another worker
    await store.accept(turn(uid, 2))
    newer = await take(store, turn(uid, 2))
    assert newer.token > eraser.token > stale.token
    with pytest.raises(StaleStateError):
        await stale.save(state)  # the worker from before the erasure writes nothing
    await store.release(newer)
