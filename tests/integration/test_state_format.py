"""Session state at rest: written as JSON, or as msgpack for a rolling upgrade from workers that
read only msgpack; either is read."""

from __future__ import annotations

import time

import msgpack
import pytest
from redis.asyncio import Redis

from contracts import keys
from contracts.state import AgentState, PendingStep
from contracts.turns import InputMessage, TurnRequest
from worker.loop.turn import new_execution
from worker.profiles.agents import AgentProfile
from worker.session.store import RedisStore, StateFormat


@pytest.mark.parametrize(("written", "first_byte"), [("json", b"{"), ("msgpack", None)])
async def test_state_written_in_either_format_is_read_by_a_worker_writing_the_other(
    redis: Redis, uid: str, written: StateFormat, first_byte: bytes | None
) -> None:
    session = f"s-{uid}"
    writer = RedisStore(redis, state_format=written)
    handle = await writer.take(session)
    assert handle is not None and handle.take_state() is None
    now = time.time()
    state = AgentState(session_id=session, agent="support", created_at=now, updated_at=now)
    saved = await handle.save(state, release=True)

    blob = await redis.hget(keys.session_state(session), "s")
    assert blob is not None
    if first_byte is not None:
        assert blob[:1] == first_byte
    else:
        assert msgpack.unpackb(blob)["session_id"] == session  # what earlier versions read

    reader = RedisStore(redis, state_format="msgpack" if written == "json" else "json")
    again = await reader.take(session)
    assert again is not None
    assert again.take_state() == saved
    await reader.release(again)


@pytest.mark.parametrize("state_format", ["json", "msgpack"])
async def test_a_state_is_parked_as_the_bytes_the_store_read_or_wrote_for_it(
    redis: Redis, uid: str, state_format: StateFormat
) -> None:
    session = f"s-{uid}"
    store = RedisStore(redis, state_format=state_format)
    handle = await store.take(session)
    assert handle is not None
    request = TurnRequest(
        turn_id=f"t-{uid}", session_id=session, agent="support", input=(InputMessage(content="hi"),)
    )
    state = new_execution(None, request, AgentProfile(name="support"), time.time())
    saved = await handle.save(state)  # a turn's first save: the model is asked next
    assert saved.version == 1
    stored = await redis.hget(keys.session_state(session), "s")
    parked = handle.park(saved)
    assert parked.blob == stored, "the bytes it wrote, not encoded again"
    assert parked.unpark() == saved  # the version (1) is put back
    again = handle.park(saved)
    assert again.blob != stored, "handed over once: parked again, it is encoded"
    assert again.unpark() == saved

    ex = saved.execution
    assert ex is not None
    pending = PendingStep(index=0, started_at=1.0)
    waiting = await handle.save(
        saved.model_copy(update={"execution": ex.model_copy(update={"pending": pending})})
    )
    assert handle.park(waiting).blob != await redis.hget(keys.session_state(session), "s"), (
        "not kept while the step waits on tools"
    )
    last = await handle.save(saved.model_copy(update={"version": waiting.version}), release=True)

    reader = await store.take(session)
    assert reader is not None
    read = reader.take_state()
    assert read == last
    parked = reader.park(read)
    assert parked.blob == await redis.hget(keys.session_state(session), "s")
    assert parked.unpark() == last
    await store.release(reader)
