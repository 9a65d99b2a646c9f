"""The session's mapping of placeholders to values: in Redis, or in memory for tests.

Redis layout: one hash per session, ``keys.redaction_map(session_id)`` (the
session's hash tag, so it sits on the session's Redis Cluster slot), with a TTL
refreshed on every use:

- ``v:<digest of label and identity>`` → the placeholder (the raw value is not
  in any field name);
- ``p:<placeholder>`` → the value as first seen;
- ``n:<label>`` → the last number handed out for the label.

Assigning is one Lua script: a value that already has a placeholder keeps it,
and two workers redacting the same new value at once get the same one. A
placeholder is resolved only in its own session's hash, so one session's
placeholders never reach another session's values.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from typing import Final, Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from contracts import keys
from worker.errors import RetryableError

Item = tuple[str, str, str]
"""``(label, identity, value)`` of a detected value."""

# KEYS: map ; ARGV: ttl_s, then (label, digest, value) triples
_ASSIGN: Final = r"""
local out = {}
for i = 2, #ARGV, 3 do
  local field = 'v:' .. ARGV[i + 1]
  local placeholder = redis.call('HGET', KEYS[1], field)
  if not placeholder then
    local n = redis.call('HINCRBY', KEYS[1], 'n:' .. ARGV[i], 1)
    placeholder = '\194\171' .. ARGV[i] .. '_' .. n .. '\194\187'
    redis.call('HSET', KEYS[1], field, placeholder, 'p:' .. placeholder, ARGV[i + 2])
  end
  out[#out + 1] = placeholder
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return out
"""


def placeholder(label: str, number: int) -> str:
    return f"«{label}_{number}»"


def digest(label: str, identity: str) -> str:
    return hashlib.blake2b(f"{label}\0{identity}".encode(), digest_size=16).hexdigest()


class Vault(Protocol):
    async def assign(self, session_id: str, items: Sequence[Item], ttl_s: int) -> list[str]:
        """The placeholder of each item, in order; new values get the label's next number."""
        ...

    async def resolve(self, session_id: str, placeholders: Sequence[str]) -> dict[str, str]:
        """The values of those ``placeholders`` the session has; unknown ones are left out."""
        ...

    async def touch(self, session_id: str, ttl_s: int) -> None:
        """Keep the session's mapping for another ``ttl_s`` seconds."""
        ...


class RedisVault:
    """``Vault`` in Redis. Redis out of reach is ``RetryableError``: the step is redone later,
    the model is never called unredacted and a tool's result is never withheld for it."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._assign = redis.register_script(_ASSIGN)

    async def assign(self, session_id: str, items: Sequence[Item], ttl_s: int) -> list[str]:
        if not items:
            return []
        args: list[str | int] = [ttl_s]
        for label, identity, value in items:
            args += [label, digest(label, identity), value]
        with _retryable():
            reply = await self._assign(keys=[keys.redaction_map(session_id)], args=args)
        return [_text(p) for p in reply]

    async def resolve(self, session_id: str, placeholders: Sequence[str]) -> dict[str, str]:
        if not placeholders:
            return {}
        with _retryable():
            values = await self.redis.hmget(
                keys.redaction_map(session_id), [f"p:{p}" for p in placeholders]
            )
        return {p: _text(v) for p, v in zip(placeholders, values, strict=True) if v is not None}

    async def touch(self, session_id: str, ttl_s: int) -> None:
        with _retryable():
            await self.redis.expire(keys.redaction_map(session_id), ttl_s)


@contextlib.contextmanager
def _retryable() -> Iterator[None]:
    try:
        yield
    except (RedisError, ConnectionError, TimeoutError) as exc:
        raise RetryableError(f"the redaction table is out of reach: {exc!r}") from exc


class MemoryVault:
    """``Vault`` in dicts, with the Redis vault's numbering (for tests and in-process use)."""

    def __init__(self) -> None:
        self.maps: dict[str, dict[str, str]] = {}
        self.ttls: dict[str, int] = {}

    async def assign(self, session_id: str, items: Sequence[Item], ttl_s: int) -> list[str]:
        fields = self.maps.setdefault(session_id, {})
        out = []
        for label, identity, value in items:
            field = "v:" + digest(label, identity)
            if field not in fields:
                number = int(fields.get(f"n:{label}", "0")) + 1
                fields[f"n:{label}"] = str(number)
                fields[field] = placeholder(label, number)
                fields["p:" + fields[field]] = value
            out.append(fields[field])
        self.ttls[session_id] = ttl_s
        return out

    async def resolve(self, session_id: str, placeholders: Sequence[str]) -> dict[str, str]:
        fields = self.maps.get(session_id, {})
        return {p: fields[f"p:{p}"] for p in placeholders if f"p:{p}" in fields}

    async def touch(self, session_id: str, ttl_s: int) -> None:
        if session_id in self.maps:
            self.ttls[session_id] = ttl_s


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
