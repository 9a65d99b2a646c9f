"""Fleet-wide model rate limits: requests and tokens per minute per model endpoint, and per
tenant (tenancy on), shared by every worker through one Redis script (GCRA;
``worker.session.scripts.ADMIT``).

A step asks before its model call; over the limit, it parks its turn as ``throttled`` until
its slot instead of sleeping in the worker (``worker.loop.engine``), as it does when the model
answers 429 with ``Retry-After``. A call's tokens are estimated before it is made (its text
over four characters a token, plus its ``max_tokens``), and a call is never charged more than
a minute's allowance, so one large request cannot wait forever. The script keeps time by
Redis's clock (``TIME``), never a worker's: a worker whose clock is off is limited like the
others (Redis Cluster runs it too: scripts replicate their effects). With neither limit set
(``LOOPWIRE_MODEL__REQUESTS_PER_MINUTE``, ``LOOPWIRE_MODEL__TOKENS_PER_MINUTE``), nothing is
asked.

A tenant's own limits (``LOOPWIRE_TENANTS__REQUESTS_PER_MINUTE``, ``…__TOKENS_PER_MINUTE``, or
its own in ``LOOPWIRE_TENANTS__LIMITS``) are the same script over the tenant's keys
(``contracts.keys.tenant_rate_limit``, one hash tag per tenant), whatever endpoint its turns
call; the step asks them first (``worker.loop.gates``). A tenant with no limit of its own is
asked nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Final

from redis.asyncio import Redis

from contracts import keys
from contracts.messages import ChatMessage
from worker.session import scripts

MAX_CACHED: Final = 10_000
"""Tenants whose limiters a worker keeps built at once (then it builds them afresh)."""


def estimate_tokens(messages: Sequence[ChatMessage], max_tokens: int | None) -> int:
    chars = sum(
        len(m.content or "") + sum(len(c.arguments) for c in m.tool_calls) for m in messages
    )
    return chars // 4 + len(messages) * 4 + (max_tokens or 0)


class RedisRateLimiter:
    """``RateLimiter`` of one model endpoint, or of one tenant, shared through Redis."""

    def __init__(
        self,
        redis: Redis,
        *,
        endpoint: str = "",
        requests_per_minute: int,
        tokens_per_minute: int,
        tenant: str | None = None,
    ) -> None:
        if tenant is not None:
            self.keys = [
                keys.tenant_rate_limit(tenant, "requests"),
                keys.tenant_rate_limit(tenant, "tokens"),
            ]
        else:
            tag = hashlib.sha256(endpoint.encode()).hexdigest()[:16]
            self.keys = [keys.rate_limit(tag, "requests"), keys.rate_limit(tag, "tokens")]
        self.rpm = requests_per_minute
        self.tpm = tokens_per_minute
        self._admit = redis.register_script(scripts.ADMIT)
        self._refund = redis.register_script(scripts.REFUND)

    async def admit(self, messages: Sequence[ChatMessage], max_tokens: int | None) -> float:
        """0 when the call may go now (and it is charged), else the seconds until its slot
        (and nothing is charged)."""
        tokens = estimate_tokens(messages, max_tokens) if self.tpm else 0
        wait_ms = await self._admit(keys=self.keys, args=[self.rpm, self.tpm, tokens])
        return int(wait_ms) / 1000

    async def refund(self, messages: Sequence[ChatMessage], max_tokens: int | None) -> None:
        """Give back what ``admit`` charged for this call: it was not made after all."""
        tokens = estimate_tokens(messages, max_tokens) if self.tpm else 0
        await self._refund(keys=self.keys, args=[self.rpm, self.tpm, tokens])


class TenantRateLimits:
    """Each tenant's own model rate limits: its ``requests_per_minute`` and
    ``tokens_per_minute`` from ``limits`` where it has them (``None``: the default), else the
    defaults; 0 is no limit. ``of`` is ``None`` for a tenant limited by neither."""

    def __init__(
        self,
        redis: Redis,
        *,
        requests_per_minute: int,
        tokens_per_minute: int,
        limits: Mapping[str, tuple[int | None, int | None]],
    ) -> None:
        self.redis = redis
        self.rpm = requests_per_minute
        self.tpm = tokens_per_minute
        self.limits = dict(limits)
        self._built: dict[str, RedisRateLimiter | None] = {}

    @property
    def any(self) -> bool:
        """Whether any tenant is limited at all."""
        return bool(self.rpm or self.tpm) or any(
            (self.rpm if rpm is None else rpm) or (self.tpm if tpm is None else tpm)
            for rpm, tpm in self.limits.values()
        )

    def of(self, tenant: str) -> RedisRateLimiter | None:
        try:
            return self._built[tenant]
        except KeyError:
            pass
        rpm, tpm = self.limits.get(tenant, (None, None))
        rpm = self.rpm if rpm is None else rpm
        tpm = self.tpm if tpm is None else tpm
        limiter = None
        if rpm or tpm:
            limiter = RedisRateLimiter(
                self.redis, requests_per_minute=rpm, tokens_per_minute=tpm, tenant=tenant
            )
        if len(self._built) >= MAX_CACHED:
            self._built.clear()
        self._built[tenant] = limiter
        return limiter
