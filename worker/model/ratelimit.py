"""Fleet-wide model rate limits: requests and tokens per minute per model endpoint, shared by
every worker through one Redis script (GCRA; ``worker.session.scripts.ADMIT``).

A step asks before its model call; over the limit, it parks its turn as ``throttled`` until
its slot instead of sleeping in the worker (``worker.loop.engine``), as it does when the model
answers 429 with ``Retry-After``. A call's tokens are estimated before it is made (its text
over four characters a token, plus its ``max_tokens``), and a call is never charged more than
a minute's allowance, so one large request cannot wait forever. The script keeps time by
Redis's clock (``TIME``), never a worker's: a worker whose clock is off is limited like the
others (Redis Cluster runs it too: scripts replicate their effects). With neither limit set
(``LOOPWIRE_MODEL__REQUESTS_PER_MINUTE``, ``LOOPWIRE_MODEL__TOKENS_PER_MINUTE``), nothing is
asked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from redis.asyncio import Redis

from contracts import keys
from contracts.messages import ChatMessage
from worker.session import scripts


def estimate_tokens(messages: Sequence[ChatMessage], max_tokens: int | None) -> int:
    chars = sum(
        len(m.content or "") + sum(len(c.arguments) for c in m.tool_calls) for m in messages
    )
    return chars // 4 + len(messages) * 4 + (max_tokens or 0)


class RedisRateLimiter:
    """``RateLimiter`` of one model endpoint, shared through Redis."""

    def __init__(
        self,
        redis: Redis,
        *,
        endpoint: str,
        requests_per_minute: int,
        tokens_per_minute: int,
    ) -> None:
        tag = hashlib.sha256(endpoint.encode()).hexdigest()[:16]
        self.keys = [keys.rate_limit(tag, "requests"), keys.rate_limit(tag, "tokens")]
        self.rpm = requests_per_minute
        self.tpm = tokens_per_minute
        self._admit = redis.register_script(scripts.ADMIT)

    async def admit(self, messages: Sequence[ChatMessage], max_tokens: int | None) -> float:
        """0 when the call may go now, else the seconds until its slot."""
        tokens = estimate_tokens(messages, max_tokens) if self.tpm else 0
        wait_ms = await self._admit(keys=self.keys, args=[self.rpm, self.tpm, tokens])
        return int(wait_ms) / 1000
