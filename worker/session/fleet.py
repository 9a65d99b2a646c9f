"""What the Redis store keeps fleet-wide, outside any session: each agent's spend per day (the
daily budgets) and the list of calls waiting for a decision (``loopwire approvals``). Mixed
into ``RedisStore`` (``worker.session.store``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Final

from redis.asyncio import Redis

from contracts import keys
from contracts.control import ApprovalRequest
from contracts.state import Spend
from worker.session.blobs import _bytes
from worker.session.port import listed

SPEND_CACHE_S: Final = 1.0


class FleetLists:
    """Mixed into ``RedisStore``: what it has that these use."""

    redis: Redis
    clock: Callable[[], float]
    _spent: dict[str, tuple[float, Spend]]
    timed: Callable[[str], AbstractContextManager[object]]

    async def spent_today(self, agent: str) -> Spend:
        """The agent's spend today, read at most once a second per agent (it moves by whole
        turns; a second's lag is nothing against a day)."""
        now = self.clock()
        cached = self._spent.get(agent)
        if cached is not None and cached[0] > now:
            return cached[1]
        with self.timed("read"):
            values = await self.redis.hgetall(keys.agent_spend(agent, _day(now)))
        fields = {_bytes(k).decode(): float(_bytes(v)) for k, v in values.items()}
        spend = Spend.model_validate(
            {k: int(v) if k != "cost_usd" and k != "wall_s" else v for k, v in fields.items()}
        )
        self._spent[agent] = (now + SPEND_CACHE_S, spend)
        return spend

    async def add_spent(self, agent: str, spend: Spend) -> None:
        key = keys.agent_spend(agent, _day(self.clock()))
        with self.timed("write"):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hincrby(key, "total_tokens", spend.total_tokens)
                pipe.hincrbyfloat(key, "cost_usd", spend.cost_usd)
                pipe.hincrby(key, "tool_calls", spend.tool_calls)
                pipe.hincrbyfloat(key, "wall_s", spend.wall_s)
                pipe.expire(key, 2 * 24 * 3600)
                await pipe.execute()

    async def note_approvals(self, requests: Sequence[ApprovalRequest]) -> None:
        """The entries are listed until their ``until`` (read past it, an entry is dropped);
        the hash expires with the latest of them (a later wait extends it, never shortens it)."""
        if requests:
            key = keys.approvals_waiting()
            fields: dict[str | bytes, str | bytes] = {
                f"{r.turn_id}:{r.call_id}": r.model_dump_json() for r in requests
            }
            until = max((r.until for r in requests if r.until is not None), default=None)
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
                if until is not None:
                    at = math.ceil(until)
                    pipe.expireat(key, at, nx=True)  # a hash without expiry gets one
                    pipe.expireat(key, at, gt=True)
                await pipe.execute()

    async def clear_approvals(self, turn_id: str, call_ids: Sequence[str]) -> None:
        if call_ids:
            fields = [f"{turn_id}:{call_id}" for call_id in call_ids]
            await self.redis.hdel(keys.approvals_waiting(), *fields)

    async def approvals(self) -> list[ApprovalRequest]:
        key, now = keys.approvals_waiting(), self.clock()
        entries = {
            field: ApprovalRequest.model_validate_json(value)
            for field, value in (await self.redis.hgetall(key)).items()
        }
        timed_out = [field for field, r in entries.items() if not listed(r, now)]
        if timed_out:
            await self.redis.hdel(key, *timed_out)
        found = [r for r in entries.values() if listed(r, now)]
        return sorted(found, key=lambda r: r.since)


def _day(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))
