"""The lease keeper against real Redis: a held lease outlives its TTL, a dropped one expires,
a lost one is let go."""

from __future__ import annotations

import asyncio
import logging

import pytest
from redis.asyncio import Redis

from contracts import keys
from worker.session.handle import SessionHandle
from worker.session.leases import LeaseKeeper
from worker.session.port import Renewal, StepSession
from worker.session.store import RedisStore

TTL_S = 0.3


async def take(store: RedisStore, session_id: str) -> SessionHandle:
    handle = await store.take(session_id)
    assert handle is not None
    return handle


async def test_a_held_lease_outlives_its_ttl_and_a_dropped_one_expires(
    redis: Redis, uid: str
) -> None:
    store = RedisStore(redis, lease_ttl_s=TTL_S)
    keeper = LeaseKeeper(store)
    held = await take(store, f"s-{uid}")
    dropped = await take(store, f"s-{uid}-2")
    keeper.hold(held)
    keeper.hold(dropped)
    keeper.drop(dropped)

    await asyncio.sleep(TTL_S * 4)

    token = await redis.get(keys.session_lease(f"s-{uid}"))
    assert token is not None and int(token) == held.token
    assert await redis.get(keys.session_lease(f"s-{uid}-2")) is None
    assert await store.take(f"s-{uid}") is None, "another worker got a lease still held"
    keeper.drop(held)
    await asyncio.sleep(TTL_S * 1.5)
    assert await redis.get(keys.session_lease(f"s-{uid}")) is None


async def test_a_lost_lease_is_logged_and_no_longer_renewed(
    redis: Redis, uid: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = RedisStore(redis, lease_ttl_s=TTL_S)
    lost: list[int] = []
    keeper = LeaseKeeper(store, lost=lambda: lost.append(1))
    handle = await take(store, f"s-{uid}")
    keeper.hold(handle, f"t-{uid}#2")
    await redis.delete(keys.session_lease(f"s-{uid}"))
    other = await take(store, f"s-{uid}")  # another worker's lease now

    with caplog.at_level(logging.WARNING, logger="loopwire.leases"):
        await asyncio.sleep(TTL_S * 2)

    assert f"lost the lease of session s-{uid} while running t-{uid}#2" in caplog.text
    assert lost == [1], "counted once"
    assert handle not in keeper.held
    token = await redis.get(keys.session_lease(f"s-{uid}"))
    assert token is None or int(token) == other.token


SLOW_TTL_S = 1.2


class SlowRenewals(RedisStore):
    """Redis answering renewals slowly (a quarter of the TTL: most of the time between two,
    well within the lease): counts how many renewals of one lease run at once."""

    def __init__(self, redis: Redis) -> None:
        super().__init__(redis, lease_ttl_s=SLOW_TTL_S)
        self.running = self.most = 0

    async def renew(self, session: StepSession) -> Renewal:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(SLOW_TTL_S / 4)
            return await super().renew(session)
        finally:
            self.running -= 1


async def test_a_slow_renewal_is_not_sent_again_on_top_of_itself(redis: Redis, uid: str) -> None:
    store = SlowRenewals(redis)
    keeper = LeaseKeeper(store)
    handle = await take(store, f"s-{uid}")
    keeper.hold(handle)
    await asyncio.sleep(SLOW_TTL_S * 2.5)
    keeper.drop(handle)
    assert store.most == 1
    token = await redis.get(keys.session_lease(f"s-{uid}"))
    assert token is not None and int(token) == handle.token
