"""A tenant's running turns at once, capped: the excess is held in line, holding no worker.

While tenancy is on and a tenant has a cap (``LOOPWIRE_TENANTS__MAX_RUNNING``, or its own in
``LOOPWIRE_TENANTS__LIMITS``), a turn takes one of its tenant's slots at its first step and
gives it back when it ends. A first step that finds every slot taken (or turns already in line
before it) puts its turn in the tenant's line and is dropped: the turn is ``throttled``. It
holds no worker, no prefetch slot and no timer: when one of the tenant's turns ends, the save
that ends it is followed by ``release``, which hands the freed slot to the first turn in line
and answers its first step for the worker to publish. A child turn (a sub-agent, a workflow
node) takes no slot: its parent holds one already, and a parent waiting on a child that waits
for the parent's slot would wait for ever.

Redis keys, under the tenant's hash tag (one slot on Redis Cluster):

- ``lw:tenant:{<tenant>}:running``: sorted set turn id -> when its slot lapses (the session
  TTL after it was taken; not the turn's deadline: a turn past it still runs until a step
  ends it, and holds its slot till then): a slot whose turn never ended (a defect) comes
  back then;
- ``lw:tenant:{<tenant>}:line``: list of the turn ids in line, first come first served, and
  ``…:sessions``: hash turn id -> its session id;
- ``lw:tenant:{<tenant>}:starting``: sorted set turn id -> when it was handed a slot, until its
  first step runs.

Crashes: a worker that dies after ``release`` handed a slot on, before it published the first
step of the turn it handed it to, leaves that turn ``starting``. Its own step message comes
back (the broker's redelivery) and repeats the end, whose ``release`` answers every turn still
starting again; so does any later ``admit`` of the tenant for a turn starting for more than
``RESEND_S``. A first step sent twice runs once (the second finds the turn started). Every
script is idempotent: ``admit`` of a turn that holds a slot says so, ``release`` of one that
holds none hands nothing on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from redis.asyncio import Redis

from contracts.keys import PREFIX

RESEND_S: Final = 10.0
"""A turn handed a slot this long ago whose first step has not run yet gets it sent again."""

_FILL: Final = """
local function fill(woken, cap, now, lapse)
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  while redis.call('ZCARD', KEYS[1]) < cap do
    local next = redis.call('LPOP', KEYS[2])
    if not next then break end
    local session = redis.call('HGET', KEYS[3], next)
    if session then
      redis.call('ZADD', KEYS[1], lapse, next)
      redis.call('ZADD', KEYS[4], now, next)
      woken[#woken + 1] = next
      woken[#woken + 1] = session
    end
  end
  return woken
end
local function resend(before)
  local woken = {}
  for _, turn in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', before)) do
    local session = redis.call('HGET', KEYS[3], turn)
    if session and redis.call('ZSCORE', KEYS[1], turn) then
      woken[#woken + 1] = turn
      woken[#woken + 1] = session
    else
      redis.call('ZREM', KEYS[4], turn)
    end
  end
  return woken
end
"""

# KEYS: running line sessions starting ; ARGV: turn, session, cap, now, lapse, resend_before
# -> {1 (a slot: run), woken...} or {0 (in line), woken...}; woken: turn, session pairs
ADMIT: Final = (
    _FILL
    + """
local turn, cap, now, lapse = ARGV[1], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
if redis.call('ZSCORE', KEYS[1], turn) then
  redis.call('ZREM', KEYS[4], turn)
  redis.call('HDEL', KEYS[3], turn)
end
local woken = fill(resend(ARGV[6]), cap, now, lapse)
if redis.call('ZSCORE', KEYS[1], turn) then
  if redis.call('HDEL', KEYS[3], turn) == 1 then  -- handed a slot just now: it runs now
    redis.call('ZREM', KEYS[4], turn)
    for i = 1, #woken, 2 do
      if woken[i] == turn then table.remove(woken, i); table.remove(woken, i); break end
    end
  end
  return {1, unpack(woken)}
end
if redis.call('HEXISTS', KEYS[3], turn) == 1 then return {0, unpack(woken)} end
if redis.call('LLEN', KEYS[2]) == 0 and redis.call('ZCARD', KEYS[1]) < cap then
  redis.call('ZADD', KEYS[1], lapse, turn)
  return {1, unpack(woken)}
end
redis.call('HSET', KEYS[3], turn, ARGV[2])
redis.call('RPUSH', KEYS[2], turn)
return {0, unpack(woken)}
"""
)

# KEYS: running line sessions starting ; ARGV: turn, cap, now, lapse -> woken: turn, session
RELEASE: Final = (
    _FILL
    + """
local turn = ARGV[1]
redis.call('ZREM', KEYS[1], turn)
redis.call('ZREM', KEYS[4], turn)
if redis.call('HDEL', KEYS[3], turn) == 1 then redis.call('LREM', KEYS[2], 0, turn) end
return fill(resend('+inf'), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4])
"""
)


def _keys(tenant: str) -> list[str]:
    base = f"{PREFIX}:tenant:{{{tenant}}}"
    return [f"{base}:running", f"{base}:line", f"{base}:sessions", f"{base}:starting"]


def _pairs(flat: list[Any]) -> list[tuple[str, str]]:
    text = [v.decode() if isinstance(v, bytes) else str(v) for v in flat]
    return list(zip(text[::2], text[1::2], strict=True))


class SlotCaps:
    """The caps of ``limits`` (tenant -> running turns at once; ``default_cap`` for the
    others, 0: no cap), and how long a slot lives: what the Redis scripts and the simulation's
    double (``worker.testing.slots``) share."""

    def __init__(
        self,
        *,
        default_cap: int = 0,
        limits: Mapping[str, int] | None = None,
        lapse_s: float = 30 * 24 * 3600,
    ) -> None:
        self.default_cap = default_cap
        self.limits = dict(limits or {})
        self.lapse_s = lapse_s
        """A slot lapses this long after it was taken (its turn never ended: a defect)."""

    def cap(self, tenant: str) -> int:
        return self.limits.get(tenant, self.default_cap)

    def capped(self, tenant: str | None) -> bool:
        return tenant is not None and self.cap(tenant) > 0


class TenantSlots(SlotCaps):
    """The tenants' slots in Redis (the scripts above)."""

    def __init__(
        self,
        redis: Redis,
        *,
        default_cap: int = 0,
        limits: Mapping[str, int] | None = None,
        lapse_s: float = 30 * 24 * 3600,
    ) -> None:
        super().__init__(default_cap=default_cap, limits=limits, lapse_s=lapse_s)
        self.redis = redis
        self._admit = redis.register_script(ADMIT)
        self._release = redis.register_script(RELEASE)

    async def admit(
        self, tenant: str, turn_id: str, session_id: str, now: float
    ) -> tuple[bool, list[tuple[str, str]]]:
        """Whether the turn runs now (else it is in line), and the (turn, session) of turns
        handed a slot whose first step is to be sent."""
        args: list[str | float] = [turn_id, session_id, self.cap(tenant), now]
        args += [now + self.lapse_s, now - RESEND_S]
        reply = await self._admit(keys=_keys(tenant), args=args)
        return bool(int(reply[0])), _pairs(reply[1:])

    async def release(self, tenant: str, turn_id: str, now: float) -> list[tuple[str, str]]:
        """The turn ended: its slot (or its place in line) is free; the (turn, session) of the
        turns handed a slot, whose first steps are to be sent."""
        args: list[str | float] = [turn_id, self.cap(tenant), now, now + self.lapse_s]
        return _pairs(list(await self._release(keys=_keys(tenant), args=args)))

    async def in_line(self, tenant: str, turn_id: str) -> bool:
        """Whether the turn waits in line (or was handed a slot and has not started yet)."""
        return bool(await self.redis.hexists(_keys(tenant)[2], turn_id))
