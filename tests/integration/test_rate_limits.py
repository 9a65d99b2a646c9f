"""The fleet-wide rate-limit script over the real Redis: a minute's worth of calls at once,
then one slot every 60/rpm seconds, shared by every limiter of the same endpoint, by Redis's
clock whatever the workers' clocks say; a tenant's own limits beside the endpoint's, and a
charge given back."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from redis.asyncio import Redis
from support_rpc import REDIS_URL

from contracts import keys
from contracts.messages import ChatMessage
from worker.model.ratelimit import RedisRateLimiter, TenantRateLimits, estimate_tokens

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [ChatMessage(role="user", content="x" * 400)]  # about 100 tokens


def limiter(redis: Redis, uid: str, rpm: int = 0, tpm: int = 0) -> RedisRateLimiter:
    return RedisRateLimiter(
        redis, endpoint=f"http://model-{uid}/v1", requests_per_minute=rpm, tokens_per_minute=tpm
    )


async def test_requests_per_minute_are_shared_by_every_worker(redis: Redis, uid: str) -> None:
    one, other = limiter(redis, uid, rpm=3), limiter(redis, uid, rpm=3)
    try:
        assert [await one.admit(MESSAGES, None) for _ in range(2)] == [0, 0]
        assert await other.admit(MESSAGES, None) == 0
        assert await other.admit(MESSAGES, None) == pytest.approx(20.0, abs=0.5)
        assert await one.admit(MESSAGES, None) == pytest.approx(20.0, abs=0.5), "not admitted"
    finally:
        await redis.delete(*one.keys)


async def test_a_call_over_the_limit_is_admitted_at_its_slot(redis: Redis, uid: str) -> None:
    fast = limiter(redis, uid, rpm=240)  # a slot every 0.25 s
    try:
        assert {await fast.admit(MESSAGES, None) for _ in range(240)} == {0}
        wait = await fast.admit(MESSAGES, None)
        assert 0 < wait <= 0.25
        await asyncio.sleep(wait)
        assert await fast.admit(MESSAGES, None) == 0
    finally:
        await redis.delete(*fast.keys)


async def test_tokens_per_minute_admit_by_the_estimated_size(redis: Redis, uid: str) -> None:
    tokens = limiter(redis, uid, tpm=250)
    cost = estimate_tokens(MESSAGES, 50)
    assert 140 <= cost <= 160
    huge = [ChatMessage(role="user", content="x" * 100_000)]
    once = limiter(redis, f"{uid}-huge", tpm=250)
    try:
        assert await tokens.admit(MESSAGES, 50) == 0
        wait = await tokens.admit(MESSAGES, 50)
        assert wait == pytest.approx((2 * cost - 250) * 60 / 250, abs=0.5)
        assert await once.admit(huge, None) == 0, "one call is charged a minute at most"
    finally:
        await redis.delete(*tokens.keys, *once.keys)


async def test_a_tenants_own_limit_holds_it_back_and_no_other_tenant(
    redis: Redis, uid: str
) -> None:
    """Tenant a is limited to 3 calls a minute, b to none; the endpoint's limit is shared."""
    a, b = f"a{uid}", f"b{uid}"
    rates = TenantRateLimits(
        redis, requests_per_minute=0, tokens_per_minute=0, limits={a: (3, None)}
    )
    own = rates.of(a)
    assert own is not None and rates.of(b) is None, "b is asked nothing"
    endpoint = limiter(redis, uid, rpm=100)
    try:
        assert [await own.admit(MESSAGES, None) for _ in range(3)] == [0, 0, 0]
        assert await own.admit(MESSAGES, None) == pytest.approx(20.0, abs=0.5)
        assert [await endpoint.admit(MESSAGES, None) for _ in range(10)] == [0] * 10
        assert await redis.exists(keys.tenant_rate_limit(b, "requests")) == 0
    finally:
        await redis.delete(*own.keys, *endpoint.keys)


async def test_a_charge_given_back_is_a_slot_again(redis: Redis, uid: str) -> None:
    """A tenant's call admitted, then refused by the endpoint, costs the tenant nothing: its
    charge is given back (tokens too), and its next call takes that slot."""
    tenant = RedisRateLimiter(redis, requests_per_minute=2, tokens_per_minute=400, tenant=f"a{uid}")
    try:
        assert await tenant.admit(MESSAGES, None) == 0
        assert await tenant.admit(MESSAGES, None) == 0
        await tenant.refund(MESSAGES, None)
        assert await tenant.admit(MESSAGES, None) == 0, "the slot given back"
        assert await tenant.admit(MESSAGES, None) == pytest.approx(30.0, abs=0.5)
        await tenant.refund(MESSAGES, None)
        await tenant.refund(MESSAGES, None)
        await tenant.refund(MESSAGES, None)  # more than was charged: never before now
        assert [await tenant.admit(MESSAGES, None) for _ in range(2)] == [0, 0]
        assert await tenant.admit(MESSAGES, None) > 0
    finally:
        await redis.delete(*tenant.keys)


# A worker process whose clock is ``argv[1]`` seconds off asks the limiter of ``argv[3]`` once.
SKEWED_WORKER = """
import asyncio, json, sys, time
real = time.time
time.time = lambda: real() + float(sys.argv[1])  # before anything of loopwire reads it
from redis.asyncio import Redis
from contracts.messages import ChatMessage
from worker.model.ratelimit import RedisRateLimiter

async def main() -> None:
    redis = Redis.from_url(sys.argv[2])
    limiter = RedisRateLimiter(
        redis, endpoint=sys.argv[3], requests_per_minute=3, tokens_per_minute=0
    )
    print(json.dumps(await limiter.admit([ChatMessage(role="user", content="x")], None)))
    await redis.aclose()

asyncio.run(main())
"""


async def admit_skewed(offset_s: float, endpoint: str) -> float:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SKEWED_WORKER,
        str(offset_s),
        REDIS_URL,
        endpoint,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0
    return float(json.loads(out))


async def test_a_worker_whose_clock_is_off_is_limited_like_the_others(
    redis: Redis, uid: str
) -> None:
    here = limiter(redis, uid, rpm=3)
    try:
        assert [await here.admit(MESSAGES, None) for _ in range(3)] == [0, 0, 0]
        ahead = await admit_skewed(3600, f"http://model-{uid}/v1")
        behind = await admit_skewed(-3600, f"http://model-{uid}/v1")
        assert ahead == pytest.approx(20.0, abs=5), "an hour ahead: not admitted over the limit"
        assert behind == pytest.approx(20.0, abs=5), "an hour behind: not kept waiting an hour"
    finally:
        await redis.delete(*here.keys)
