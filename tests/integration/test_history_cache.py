"""A worker's copy of a session's history (``worker.session.history_cache``), against real
Redis: a lease reads only what the copy lacks, and a copy that may no longer be the history's
start (cut back, erased, written by a worker that does not vouch for it, a save whose outcome
is unknown) is never used: what the step sees is always what Redis holds."""

from __future__ import annotations

import time

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from contracts import keys
from contracts.codec import encode
from contracts.messages import ChatMessage
from contracts.turns import InputMessage, TurnRequest
from worker.loop.turn import closed, new_execution, turn_result
from worker.profiles.agents import AgentProfile
from worker.session.handle import SessionHandle
from worker.session.history_cache import HistoryCache, HistoryRead
from worker.session.store import RedisStore

AGENT = AgentProfile(name="support")


def request(uid: str, n: int) -> TurnRequest:
    return TurnRequest(
        turn_id=f"t-{uid}-{n}",
        session_id=f"s-{uid}",
        agent="support",
        input=(InputMessage(content=f"question {n}"),),
    )


async def lease(store: RedisStore, uid: str) -> SessionHandle:
    handle = await store.take(f"s-{uid}")
    assert isinstance(handle, SessionHandle), "the lease should be free"
    return handle


def read_of(handle: SessionHandle) -> HistoryRead:
    read = handle._history
    assert read is not None
    return read


async def run_turn(store: RedisStore, uid: str, n: int) -> list[str]:
    """Run turn ``n`` of the session as a worker does (the history loaded once, then the
    question and the answer saved); the history the step saw, as contents."""
    turn = request(uid, n)
    await store.accept(turn)
    handle = await lease(store, uid)
    state = handle.take_state()
    state = new_execution(state, turn, AGENT, time.time())
    seen = [m.content or "" for m in await handle.load_messages(state)]
    state = await handle.save(state, append=[m.to_chat() for m in turn.input])
    answer = ChatMessage(role="assistant", content=f"answer {n}")
    result = turn_result(state, "stop", answer.content, None, time.time())
    await handle.save(closed(state, appended=2, now=time.time()), append=[answer], result=result)
    return seen


def contents(n: int) -> list[str]:
    return [text for k in range(1, n + 1) for text in (f"question {k}", f"answer {k}")]


def copying(redis: Redis) -> RedisStore:
    return RedisStore(redis, history_cache=HistoryCache(1 << 30, 0))


async def test_a_lease_reads_only_what_the_copy_lacks(redis: Redis, uid: str) -> None:
    worker = copying(redis)
    assert await run_turn(worker, uid, 1) == []
    assert await run_turn(worker, uid, 2) == contents(1)
    handle = await lease(worker, uid)
    read = read_of(handle)
    assert (read.start, read.items, read.tail) == (4, 4, [b""])  # nothing read again
    state = handle.take_state()
    assert [m.content for m in await handle.load_messages(state)] == contents(2)  # type: ignore[arg-type]
    await worker.release(handle)


async def test_what_another_worker_appended_comes_with_the_lease(redis: Redis, uid: str) -> None:
    first, other = copying(redis), RedisStore(redis)
    await run_turn(first, uid, 1)
    await run_turn(first, uid, 2)  # the copy holds 2 items
    assert await run_turn(other, uid, 3) == contents(2)
    assert await run_turn(first, uid, 4) == contents(3)
    handle = await lease(first, uid)
    assert (read_of(handle).start, read_of(handle).items) == (8, 8)
    await first.release(handle)


async def test_a_history_cut_back_by_another_worker_is_read_whole(redis: Redis, uid: str) -> None:
    """A cancel with rollback elsewhere, then turns that make the list as long again: the copy
    is not the history's start any more, and its generation says so."""
    first, other = copying(redis), RedisStore(redis)
    for n in (1, 2, 3):
        await run_turn(first, uid, n)
    rolled = request(uid, 4)
    await other.accept(rolled)
    handle = await lease(other, uid)
    state = new_execution(handle.take_state(), rolled, AGENT, time.time())
    start = state.history_len
    state = await handle.save(state, append=[m.to_chat() for m in rolled.input])
    result = turn_result(state, "cancelled", None, None, time.time())
    final = closed(state, appended=0, now=time.time()).model_copy(update={"history_len": 2})
    await handle.save(final, result=result, cut_to=2)
    assert start == 6
    for n in (5, 6, 7):
        await run_turn(other, uid, n)  # 8 items again
    seen = await run_turn(first, uid, 8)
    assert seen == [*contents(1), *(t for k in (5, 6, 7) for t in (f"question {k}", f"answer {k}"))]


async def test_a_save_that_does_not_vouch_for_the_history_is_read_whole(
    redis: Redis, uid: str
) -> None:
    """A worker of an earlier release saves without the generation's mark (and may cut): the
    next lease reads the whole history; once a save vouches for it again, the next lease reads
    it whole and keeps it, and the one after reads only what it lacks."""
    first = copying(redis)
    for n in (1, 2):
        await run_turn(first, uid, n)
    sid = f"s-{uid}"
    history = keys.session_history(sid)
    await redis.hincrby(keys.session_state(sid), "v", 1)  # its save: no 'w'
    await redis.ltrim(history, 0, 0)
    await redis.rpush(
        history, *(encode(ChatMessage(role="user", content=f"x{k}")) for k in range(5))
    )
    handle = await lease(first, uid)
    assert read_of(handle).start == 0
    state = handle.take_state()
    seen = [m.content for m in await handle.load_messages(state)]  # type: ignore[arg-type]
    assert seen == ["question 1", "x0", "x1", "x2", "x3", "x4"]
    await first.release(handle)
    assert await run_turn(first, uid, 3) == seen
    assert await run_turn(first, uid, 4) == [*seen, "question 3", "answer 3"]
    again = await lease(first, uid)
    assert (read_of(again).start, read_of(again).items) == (10, 10)
    await first.release(again)


async def test_a_session_erased_and_begun_again_is_read_whole(redis: Redis, uid: str) -> None:
    first, other = copying(redis), RedisStore(redis)
    for n in (1, 2):
        await run_turn(first, uid, n)
    sid = f"s-{uid}"
    await redis.delete(
        *(k(sid) for k in (keys.session_state, keys.session_history, keys.session_fence)),
        keys.session_turns(sid),
    )
    for n in (3, 4):
        await run_turn(other, uid, n)  # as long as the copy again
    assert await run_turn(first, uid, 5) == contents(4)[4:]


async def test_a_save_whose_outcome_is_unknown_drops_the_copy(
    redis: Redis, uid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = HistoryCache(1 << 30, 0)
    worker = RedisStore(redis, history_cache=cache)
    await run_turn(worker, uid, 1)
    await run_turn(worker, uid, 2)
    assert cache.get(f"s-{uid}") is not None
    turn = request(uid, 3)
    await worker.accept(turn)
    handle = await lease(worker, uid)
    state = new_execution(handle.take_state(), turn, AGENT, time.time())
    await handle.load_messages(state)

    async def lost(*_args: object, **_kwargs: object) -> object:
        raise RedisConnectionError("connection reset while the save was sent")

    monkeypatch.setattr(worker, "_save", lost)
    with pytest.raises(RedisConnectionError):
        await handle.save(state, append=[m.to_chat() for m in turn.input])
    assert cache.get(f"s-{uid}") is None
    monkeypatch.undo()
    await worker.release(handle)
    assert await run_turn(worker, uid, 3) == contents(2)
