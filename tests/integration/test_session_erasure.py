"""Deleting a session against real Redis, the sequencer driven in this process (the world of the
unit tests over the Redis store): a turn sent while the session is erased is not lost, the
erasure keeps its lease, and the child sessions its turns started go with it."""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis

from contracts import keys
from contracts.sessions import SessionDelete
from contracts.turns import InputMessage, TurnRequest
from tests.unit.world import calls, last_user, says, tool_results, world
from worker.loop.ports import ModelRequest
from worker.sequencing.actions import Action, Busy, Control, Start
from worker.session.port import Renewal, StepSession
from worker.session.records import SessionRecords
from worker.session.store import RedisStore


def turn(session: str, turn_id: str, agent: str, text: str) -> TurnRequest:
    return TurnRequest(
        turn_id=turn_id,
        session_id=session,
        agent=agent,
        input=(InputMessage(content=text),),
        reply_to="client.replies",
    )


def echo(request: ModelRequest) -> Any:
    return says(f"re: {last_user(request)}")


def delete(session: str) -> Control:
    return Control(SessionDelete(session_id=session, reason="erasure request", reply_to="r.q"))


async def keys_of(redis: Redis, session: str) -> list[str]:
    """The session's keys still in Redis, but its fence (a bare counter, kept with an expiry so
    that fencing tokens never go back)."""
    fence = keys.session_fence(session)
    assert not await redis.exists(fence) or await redis.ttl(fence) > 0
    found = [k.decode() async for k in redis.scan_iter(match=f"*{{{session}}}*")]
    return sorted(k for k in found if k != fence)


class Interleaved(SessionRecords):
    """The erasure, with ``meanwhile`` run once while it collects what it deletes."""

    def __init__(self, redis: Redis, meanwhile: Any) -> None:
        super().__init__(redis)
        self.meanwhile = meanwhile

    async def _tool_calls(self, session_id: str) -> list[str]:
        meanwhile, self.meanwhile = self.meanwhile, None
        if meanwhile is not None:
            await meanwhile()
        return await super()._tool_calls(session_id)


async def test_a_turn_sent_while_its_session_is_erased_runs_after_it(
    redis: Redis, uid: str
) -> None:
    session = f"s-{uid}"
    w = world({"agents": [{"name": "support"}]}, {"support": echo}, store=RedisStore(redis))  # type: ignore[arg-type]
    await w.run(turn(session, f"t-{uid}-1", "support", "my card is 4111"))
    late = turn(session, f"t-{uid}-2", "support", "are you there?")
    answered: list[Action] = []

    async def accept_late() -> None:
        answered.extend(await w.sequencer.on_request(late))

    w.sequencer.records = Interleaved(redis, accept_late)
    await w.drive([delete(session)])
    assert answered, "the request came while the session was erased"
    # as the transport does: a busy message comes back later, the others are published
    await w.drive([Start(late)] if Busy() in answered else answered)

    assert w.answered and w.answered[0].body.ok
    assert w.result(late.turn_id).content == "re: are you there?"
    records = SessionRecords(redis)
    history, _ = await records.history(session, 0, 10, newest_first=False)
    assert [m.content for m in history] == ["are you there?", "re: are you there?"]
    assert await records.result(late.turn_id) == w.result(late.turn_id)
    assert await records.result(f"t-{uid}-1") is None
    assert [(t.turn_id, t.status) for t in await records.turns(session)] == [(late.turn_id, "done")]


class CountedRenewals(RedisStore):
    def __init__(self, redis: Redis, lease_ttl_s: float, enough: int) -> None:
        super().__init__(redis, lease_ttl_s=lease_ttl_s)
        self.renewed = 0
        self.enough = enough
        self.renewed_enough = asyncio.Event()

    async def renew(self, session: StepSession) -> Renewal:
        renewed = await super().renew(session)
        self.renewed += renewed == "held"
        if self.renewed >= self.enough:
            self.renewed_enough.set()
        return renewed


async def test_an_erasure_keeps_its_lease_while_it_works(redis: Redis, uid: str) -> None:
    session = f"s-{uid}"
    # four renewals at a third of the TTL each: the lease outlives its TTL by a third
    store = CountedRenewals(redis, lease_ttl_s=0.3, enough=4)
    w = world({"agents": [{"name": "support"}]}, {"support": echo}, store=store)  # type: ignore[arg-type]
    await w.run(turn(session, f"t-{uid}-1", "support", "hello"))
    store.renewed = 0
    kept_out: list[bool] = []

    async def slow() -> None:
        await asyncio.wait_for(store.renewed_enough.wait(), 5)
        kept_out.append(await store.take(session) is None)  # no step can take the session

    w.sequencer.records = Interleaved(redis, slow)
    await w.drive([delete(session)])
    assert kept_out == [True]
    assert w.answered and w.answered[0].body.ok and w.answered[0].body.deleted_keys > 0
    assert await keys_of(redis, session) == []


def lead(request: ModelRequest) -> Any:
    if tool_results(request):
        return says("done: " + " | ".join(tool_results(request)))
    return calls(("researcher", "find the order"), ("writer", "draft a mail"))


async def test_deleting_a_session_deletes_the_child_sessions_its_turns_started(
    redis: Redis, uid: str
) -> None:
    session, named = f"s-{uid}", f"s-{uid}-named"
    profiles = {
        "agents": [
            {"name": "lead", "agents": ["researcher", {"agent": "writer", "session": named}]},
            {"name": "researcher"},
            {"name": "writer"},
        ]
    }
    answers = {"lead": lead, "researcher": echo, "writer": echo}
    w = world(profiles, answers, store=RedisStore(redis))  # type: ignore[arg-type]
    w.sequencer.records = SessionRecords(redis)
    try:
        await w.run(turn(session, f"t-{uid}-1", "lead", "where is my order?"))
        assert w.result(f"t-{uid}-1").content == "done: re: find the order | re: draft a mail"
        child = next(r.session_id for r in w.starts() if r.agent == "researcher")
        assert child != session and await keys_of(redis, child)

        await w.drive([delete(session)])

        assert w.answered and w.answered[0].body.ok
        assert await keys_of(redis, session) == []
        assert await keys_of(redis, child) == []  # its history held the user's text
        assert await SessionRecords(redis).state(named) is not None  # the caller named it
    finally:
        for kept in (named, *(r.session_id for r in w.starts())):
            found = await keys_of(redis, kept)
            if found:
                await redis.delete(*found)
