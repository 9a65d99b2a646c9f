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
from worker.agents import AgentProfile
from worker.loop.records import Parked, new_execution
from worker.session.store import RedisStore, StateFormat


@pytest.mark.parametrize(("written", "first_byte"), [("json", b"{"), ("msgpack", None)])
async def test_state_written_in_either_format_is_read_by_a_worker_writing_the_other(
    redis: Redis, uid: str, written: StateFormat, first_byte: bytes | None
) -> None:
    session = f"s-{uid}"
    writer = RedisStore(redis, state_format=written)
    lease = await writer.lease(session)
    assert lease is not None and lease.state is None
    now = time.time()
    state = AgentState(session_id=session, agent="support", created_at=now, updated_at=now)
    saved = await writer.handle(lease).save(state, release=True)

    blob = await redis.hget(keys.session_state(session), "s")
    assert blob is not None
    if first_byte is not None:
        assert blob[:1] == first_byte
    else:
        assert msgpack.unpackb(blob)["session_id"] == session  # what earlier versions read

    reader = RedisStore(redis, state_format="msgpack" if written == "json" else "json")
    again = await reader.lease(session)
    assert again is not None
    assert again.state == saved
    await reader.release(again)


@pytest.mark.parametrize("state_format", ["json", "msgpack"])
async def test_a_state_is_parked_as_the_bytes_the_store_read_or_wrote_for_it(
    redis: Redis, uid: str, state_format: StateFormat
) -> None:
    session = f"s-{uid}"
    store = RedisStore(redis, state_format=state_format)
    lease = await store.lease(session)
    assert lease is not None
    handle = store.handle(lease)
    request = TurnRequest(
        turn_id=f"t-{uid}", session_id=session, agent="support", input=(InputMessage(content="hi"),)
    )
    state = new_execution(None, request, AgentProfile(name="support"), time.time())
    saved = await handle.save(state)  # a turn's first save: the model is asked next
    assert saved.version == 1
    assert handle.stored(saved.model_copy()) is None, "only for the very object it returned"

    saved = await handle.save(saved.model_copy(update={"history_len": 3}))
    written = handle.stored(saved)
    assert written == await redis.hget(keys.session_state(session), "s")
    assert handle.stored(saved) is None, "handed out once"
    assert Parked(saved, written).state() == saved  # the version (2) is put back

    ex = saved.execution
    assert ex is not None
    pending = PendingStep(index=0, started_at=1.0)
    waiting = await handle.save(
        saved.model_copy(update={"execution": ex.model_copy(update={"pending": pending})})
    )
    assert handle.stored(waiting) is None, "not kept while the step waits on tools"
    last = await handle.save(saved.model_copy(update={"version": waiting.version}), release=True)
    assert handle.stored(last) is None, "nor after the step's last save"

    again = await store.lease(session)
    assert again is not None
    reader = store.handle(again)
    read = reader.take_state()
    assert read == last
    parked = Parked(read, reader.stored(read))
    del read
    assert parked.state() == last
    await store.release(again)
