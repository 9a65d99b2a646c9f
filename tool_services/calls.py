"""Duplicate suppression for tool calls: claim, lease, stored reply (Redis, atomic Lua scripts).

Per idempotency key ``<turn_id>:<tool_call_id>`` there are two keys sharing one
hash tag (so the scripts also work on Redis Cluster):

- ``keys.tool_call(key)`` — a hash: ``owner`` (instance id of the instance that
  claimed the call), and once finished ``reply`` (msgpack ``ToolCallReply``)
  and ``status``. TTL ``idempotency_ttl_s``, set when claimed.
- ``keys.tool_call_lease(key)`` — a string (a per-run token) with a short PX
  TTL that the owner renews while the function runs. A claim without a lease
  means its owner died mid-call.

``claim`` decides, atomically, what a delivery of a call must do:

- ``done``: a reply is stored — answer with it, do not run.
- ``run``: nobody had claimed it (HSETNX owner) — run it.
- ``running``: claimed and the lease is alive — wait for the stored reply.
- ``takeover``: claimed, lease gone, tool idempotent — this instance now owns
  it (owner and lease rewritten) and runs it again.
- ``orphaned``: claimed, lease gone, tool not idempotent — the caller stores
  and sends an ``unknown`` reply; the call is not run again.

``store`` is first-writer-wins: it returns the reply already stored, if any,
so every caller of one key gets the same answer.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from typing import Any, Final

from redis.asyncio import Redis

from contracts import keys

Arg = bytes | str | int

_CLAIM: Final = """
local reply = redis.call('HGET', KEYS[1], 'reply')
if reply then return {'done', reply} end
if redis.call('HSETNX', KEYS[1], 'owner', ARGV[1]) == 1 then
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  return {'run', ''}
end
local owner = redis.call('HGET', KEYS[1], 'owner') or ''
if redis.call('EXISTS', KEYS[2]) == 1 then return {'running', owner} end
if ARGV[5] ~= '1' then return {'orphaned', owner} end
redis.call('HSET', KEYS[1], 'owner', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return {'takeover', owner}
"""

_REFRESH: Final = """
if redis.call('GET', KEYS[2]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('HGET', KEYS[1], 'owner') == ARGV[3]
    and redis.call('HEXISTS', KEYS[1], 'reply') == 0 then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

_STORE: Final = """
local existing = redis.call('HGET', KEYS[1], 'reply')
if not existing then
  redis.call('HSET', KEYS[1], 'reply', ARGV[1], 'status', ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
if ARGV[4] ~= '' and redis.call('GET', KEYS[2]) == ARGV[4] then
  redis.call('DEL', KEYS[2])
end
return existing
"""

_RELEASE: Final = """
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
if ARGV[3] == '1' and redis.call('HGET', KEYS[1], 'owner') == ARGV[2]
    and redis.call('HEXISTS', KEYS[1], 'reply') == 0 then
  redis.call('HDEL', KEYS[1], 'owner')
end
return 0
"""


class ClaimKind(enum.Enum):
    DONE = "done"
    RUN = "run"
    RUNNING = "running"
    TAKEOVER = "takeover"
    ORPHANED = "orphaned"


@dataclass(frozen=True, slots=True)
class Claim:
    kind: ClaimKind
    key: str
    token: str
    """This run's lease token (meaningful for ``run`` and ``takeover``)."""
    reply: bytes | None = None
    """The stored reply (``done``)."""
    owner: str = ""
    """The instance that owns the call (``running``, ``takeover``, ``orphaned``)."""

    @property
    def owns(self) -> bool:
        return self.kind in (ClaimKind.RUN, ClaimKind.TAKEOVER)


class CallStore:
    """The claim/lease/reply protocol of one tool service instance."""

    def __init__(self, redis: Redis, *, instance_id: str, lease_ms: int, ttl_s: int) -> None:
        self.redis = redis
        self.instance_id = instance_id
        self.lease_ms = lease_ms
        self.ttl_s = ttl_s
        self._claim = redis.register_script(_CLAIM)
        self._refresh = redis.register_script(_REFRESH)
        self._store = redis.register_script(_STORE)
        self._release = redis.register_script(_RELEASE)

    @staticmethod
    def _keys(key: str) -> list[str]:
        return [keys.tool_call(key), keys.tool_call_lease(key)]

    async def claim(self, key: str, *, idempotent: bool) -> Claim:
        token = f"{self.instance_id}:{uuid.uuid4().hex}"
        args: list[Arg] = [
            self.instance_id,
            token,
            self.lease_ms,
            self.ttl_s,
            "1" if idempotent else "0",
        ]
        result: Any = await self._claim(keys=self._keys(key), args=args)
        kind = ClaimKind(_text(result[0]))
        if kind is ClaimKind.DONE:
            return Claim(kind, key, token, reply=bytes(result[1]))
        return Claim(kind, key, token, owner=_text(result[1]))

    async def refresh(self, claim: Claim) -> bool:
        """Renew the lease; False when another instance took the call over."""
        args: list[Arg] = [claim.token, self.lease_ms, self.instance_id]
        result: Any = await self._refresh(keys=self._keys(claim.key), args=args)
        return bool(result)

    async def store(self, key: str, reply: bytes, status: str, *, token: str = "") -> bytes | None:
        """Store the reply unless one is stored already; return the earlier one if so."""
        args: list[Arg] = [reply, status, self.ttl_s, token]
        result: Any = await self._store(keys=self._keys(key), args=args)
        return bytes(result) if result else None

    async def release(self, claim: Claim, *, forget_owner: bool) -> None:
        """Drop the lease (and, with ``forget_owner``, the claim) of a run that did not finish."""
        args: list[Arg] = [claim.token, self.instance_id, "1" if forget_owner else "0"]
        await self._release(keys=self._keys(claim.key), args=args)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
