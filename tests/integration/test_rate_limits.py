"""The fleet-wide rate-limit script over the real Redis: a minute's worth of calls at once,
then one slot every 60/rpm seconds, shared by every limiter of the same endpoint."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from contracts.messages import ChatMessage
from worker.model.ratelimit import RedisRateLimiter, estimate_tokens

pytestmark = pytest.mark.integration

MESSAGES = [ChatMessage(role="user", content="x" * 400)]  # about 100 tokens


def limiter(
    redis: Redis, uid: str, clock: list[float], rpm: int = 0, tpm: int = 0
) -> RedisRateLimiter:
    return RedisRateLimiter(
        redis,
        endpoint=f"http://model-{uid}/v1",
        requests_per_minute=rpm,
        tokens_per_minute=tpm,
        clock=lambda: clock[0],
    )


async def test_requests_per_minute_are_shared_by_every_worker(redis: Redis, uid: str) -> None:
    clock = [1_000_000.0]
    one, other = limiter(redis, uid, clock, rpm=3), limiter(redis, uid, clock, rpm=3)
    try:
        assert [await one.admit(MESSAGES, None) for _ in range(2)] == [0, 0]
        assert await other.admit(MESSAGES, None) == 0
        assert await other.admit(MESSAGES, None) == pytest.approx(20.0, abs=0.01)
        assert await one.admit(MESSAGES, None) == pytest.approx(20.0, abs=0.01), "not admitted"
        clock[0] += 20
        assert await one.admit(MESSAGES, None) == 0
        assert await other.admit(MESSAGES, None) == pytest.approx(20.0, abs=0.01)
    finally:
        await redis.delete(*one.keys)


async def test_tokens_per_minute_admit_by_the_estimated_size(redis: Redis, uid: str) -> None:
    clock = [2_000_000.0]
    tokens = limiter(redis, uid, clock, tpm=250)
    cost = estimate_tokens(MESSAGES, 50)
    assert 140 <= cost <= 160
    try:
        assert await tokens.admit(MESSAGES, 50) == 0
        wait = await tokens.admit(MESSAGES, 50)
        assert wait == pytest.approx((2 * cost - 250) * 60 / 250, abs=0.01)
        huge = [ChatMessage(role="user", content="x" * 100_000)]
        clock[0] += 3600
        assert await tokens.admit(huge, None) == 0, "one call is charged a minute at most"
    finally:
        await redis.delete(*tokens.keys)
