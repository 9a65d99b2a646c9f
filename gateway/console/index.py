"""The console's index of turns: what the live list shows, kept by the gateway from the events.

Nothing here is a session's key: the index is the gateway's own, under
``lw:console:{<tenant>}:…`` (the tenant in the hash tag, so that one script updates a turn's
row, the tenant's list and the turn's event log in one slot on Redis Cluster):

- ``…:turns``: a sorted set of the tenant's turns by when they were first seen, trimmed to the
  newest ``keep`` (older rows expire with their hashes);
- ``…:turn:<turn_id>``: the turn's row (agent, session, parent and root turn, status, what it
  waits for, its last step, finish reason, usage and cost once it ended, trace id);
- ``…:events:<turn_id>``: the turn's events in a compact form (type, time, step and the data a
  timeline shows: tool attempts and outcomes, waits and their ends, model usage), the last
  ``EVENTS_KEPT``.

Events arrive at least once and, across replicas, in any order. So ``apply`` is one script
that orders a row's status by rank, then by the event's time: ``queued`` < ``running`` =
``parked`` (the later event wins) < ``done`` and ``rejected``, which nothing overwrites. A
duplicate event (same id after a redelivered step) appends a duplicate to the log; readers drop
events by id. Everything expires ``ttl_s`` after the turn's last event.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from contracts import tenancy
from contracts.events import Event

EVENTS_KEPT = 2000
"""Events of one turn kept for its timeline (the newest)."""

TENANTS_KEY = "lw:console:tenants"
"""Every tenant the index has seen (an admin key's tenant switch lists them)."""

_APPLY = """
local t = tonumber(ARGV[2])
local rank = tonumber(redis.call('HGET', KEYS[1], 'rank') or '-1')
local at = tonumber(redis.call('HGET', KEYS[1], 'status_at') or '0')
local r = tonumber(ARGV[4])
if ARGV[3] ~= '' and (r > rank or (r == rank and r < 3 and t >= at)) then
  redis.call('HSET', KEYS[1], 'status', ARGV[3], 'rank', ARGV[4], 'status_at', ARGV[2],
             'waiting', ARGV[5])
end
local i = 10
local always = false
while i <= #ARGV do
  if ARGV[i] == '' then
    always = true
    i = i + 1
  else
    if always then
      redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    else
      redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1])
    end
    i = i + 2
  end
end
local updated = tonumber(redis.call('HGET', KEYS[1], 'updated_at') or '0')
if t > updated then redis.call('HSET', KEYS[1], 'updated_at', ARGV[2]) end
local created = redis.call('HGET', KEYS[1], 'created_at')
if not created or t < tonumber(created) then
  created = ARGV[2]
  redis.call('HSET', KEYS[1], 'created_at', created)
end
redis.call('HSET', KEYS[1], 'turn_id', ARGV[1])
redis.call('ZADD', KEYS[2], 'LT', created, ARGV[1])
local kept = tonumber(ARGV[7])
local n = redis.call('ZCARD', KEYS[2])
if n > kept then redis.call('ZREMRANGEBYRANK', KEYS[2], 0, n - kept - 1) end
local ttl = tonumber(ARGV[6])
if ARGV[8] ~= '' then
  redis.call('RPUSH', KEYS[3], ARGV[8])
  redis.call('LTRIM', KEYS[3], -tonumber(ARGV[9]), -1)
  redis.call('EXPIRE', KEYS[3], ttl)
end
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
return redis.call('HGETALL', KEYS[1])
"""

_DONE = {"turn.completed", "turn.failed", "turn.cancelled"}
_STATUS: dict[str, tuple[str, int, str]] = {
    "turn.accepted": ("queued", 0, ""),
    "turn.started": ("running", 1, ""),
    "tool.invoking": ("running", 1, ""),
    "tool.invoked": ("running", 1, ""),
    "step.completed": ("running", 1, ""),
    "state.updated": ("running", 1, ""),
    "approval.requested": ("parked", 1, "approval"),
    "child.started": ("parked", 1, "children"),
    "turn.throttled": ("parked", 1, "throttled"),
    "turn.rejected": ("rejected", 3, ""),
}
_KEPT_DATA: dict[str, tuple[str, ...]] = {
    "turn.accepted": ("persist",),
    "turn.started": ("history_len", "max_tool_iterations"),
    "turn.throttled": ("until",),
    "tool.invoking": ("tool", "call_id", "attempt"),
    "tool.invoked": ("tool", "call_id", "outcome", "duration_s", "error", "truncated"),
    "step.completed": (
        "step_type",
        "finish_reason",
        "tool_calls",
        "usage",
        "duration_s",
        "model_duration_s",
        "model",
        "provider",
        "summarized",
    ),
    "approval.requested": ("call_id", "tool", "until"),
    "approval.decided": ("call_id", "decision", "by", "message"),
    "budget.exhausted": ("budget", "limit", "used", "final_call"),
    "child.started": ("call_id", "turn_id", "session_id", "agent"),
    "child.finished": ("call_id", "turn_id", "agent", "finish_reason", "usage", "cost_usd"),
    "turn.rejected": ("code", "reason"),
}
_RESULT_KEPT = ("finish_reason", "stopped_by", "usage", "cost_usd", "steps", "duration_s")


def prefix(tenant: str) -> str:
    return f"lw:console:{{{tenant}}}"


def tenant_of(routing_key: str) -> str:
    """The tenant of an event by its routing key: the first of five words while tenancy is on
    (``<tenant>.<entity>.<action>.<agent>.<turn_id>``), else the default tenant."""
    words = routing_key.split(".")
    return words[0] if len(words) == 5 and tenancy.valid(words[0]) else tenancy.DEFAULT


def _data(event: Event) -> dict[str, Any]:
    dumped: dict[str, Any] = event.data.model_dump(mode="json")
    return dumped


def _status(event: Event) -> tuple[str, int, str]:
    if event.type in _DONE:
        return ("done", 3, "")
    return _STATUS.get(event.type, ("", 0, ""))


def record(event: Event) -> dict[str, Any]:
    """What the timeline keeps of an event."""
    data = _data(event)
    kept: dict[str, Any] = {k: data[k] for k in _KEPT_DATA.get(event.type, ()) if k in data}
    result = data.get("result")
    if event.type in _DONE and isinstance(result, dict):
        kept.update({k: result[k] for k in _RESULT_KEPT if k in result})
        error = result.get("error")
        if isinstance(error, dict):
            kept["error"] = error.get("message")
    return {"id": event.id, "type": event.type, "time": event.time, "step": event.step, **kept}


@dataclass(frozen=True, slots=True)
class Row:
    """A turn as the live list shows it."""

    turn_id: str
    agent: str
    session_id: str
    status: str
    waiting: str
    created_at: float
    updated_at: float
    step: int | None
    finish_reason: str
    parent_turn_id: str
    root_turn_id: str
    trace_id: str
    tokens: int
    cost_usd: float

    @classmethod
    def of(cls, fields: dict[str, str]) -> Row:
        step = fields.get("step", "")
        return cls(
            turn_id=fields.get("turn_id", ""),
            agent=fields.get("agent", ""),
            session_id=fields.get("session_id", ""),
            status=fields.get("status", "queued"),
            waiting=fields.get("waiting", ""),
            created_at=float(fields.get("created_at") or 0),
            updated_at=float(fields.get("updated_at") or 0),
            step=int(step) if step.isdigit() else None,
            finish_reason=fields.get("finish_reason", ""),
            parent_turn_id=fields.get("parent_turn_id", ""),
            root_turn_id=fields.get("root_turn_id", ""),
            trace_id=fields.get("trace_id", ""),
            tokens=int(fields.get("tokens") or 0),
            cost_usd=float(fields.get("cost_usd") or 0),
        )

    def public(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def _text(fields: list[Any]) -> dict[str, str]:
    items = [v.decode() if isinstance(v, bytes) else str(v) for v in fields]
    return dict(zip(items[::2], items[1::2], strict=True))


class Index:
    def __init__(self, redis: Redis, *, ttl_s: int, keep: int) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self.keep = keep
        self._apply = redis.register_script(_APPLY)
        self._tenants: set[str] = set()

    async def apply(self, tenant: str, event: Event, trace_id: str | None = None) -> Row | None:
        """Fold ``event`` into its turn's row and log; the row as it now stands."""
        if not event.turn_id or event.type in ("message.delta", "session.deleted"):
            return None
        if tenant not in self._tenants:
            await self.redis.sadd(TENANTS_KEY, tenant)
            self._tenants.add(tenant)
        status, rank, waiting = _status(event)
        once = {
            "agent": event.agent,
            "session_id": event.session_id or "",
            "parent_turn_id": event.parent_turn_id or "",
            "root_turn_id": event.root_turn_id or "",
            "trace_id": trace_id or "",
        }
        always: dict[str, str] = {}
        if event.step is not None and event.type == "step.completed":
            always["step"] = str(event.step)
        kept = record(event)
        if event.type in _DONE:
            usage = kept.get("usage") or {}
            always.update(
                finish_reason=str(kept.get("finish_reason") or ""),
                tokens=str(int(usage.get("total_tokens") or 0)),
                cost_usd=str(kept.get("cost_usd") or 0),
            )
        args: list[str | float | int] = [
            event.turn_id,
            repr(event.time),
            status,
            rank,
            waiting,
            self.ttl_s,
            self.keep,
            json.dumps(kept, default=str),
            EVENTS_KEPT,
        ]
        for name, value in once.items():
            if value:
                args += [name, value]
        args.append("")
        for name, value in always.items():
            args += [name, value]
        p = prefix(tenant)
        keys = [f"{p}:turn:{event.turn_id}", f"{p}:turns", f"{p}:events:{event.turn_id}"]
        fields = await self._apply(keys=keys, args=args)
        return Row.of(_text(fields))

    async def rows(self, tenant: str, limit: int) -> list[Row]:
        """The tenant's newest ``limit`` turns, newest first."""
        p = prefix(tenant)
        ids = await self.redis.zrevrange(f"{p}:turns", 0, limit - 1)
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for raw in ids:
                turn_id = raw.decode() if isinstance(raw, bytes) else str(raw)
                pipe.hgetall(f"{p}:turn:{turn_id}")
            found = await pipe.execute()
        return [Row.of(_text([x for kv in f.items() for x in kv])) for f in found if f]

    async def row(self, tenant: str, turn_id: str) -> Row | None:
        fields = await self.redis.hgetall(f"{prefix(tenant)}:turn:{turn_id}")
        return Row.of(_text([x for kv in fields.items() for x in kv])) if fields else None

    async def events(self, tenant: str, turn_id: str) -> list[dict[str, Any]]:
        """The turn's kept events, oldest first, each once (by id)."""
        raw = await self.redis.lrange(f"{prefix(tenant)}:events:{turn_id}", 0, -1)
        seen: set[str] = set()
        found = []
        for item in raw:
            event = json.loads(item)
            if event["id"] not in seen:
                seen.add(event["id"])
                found.append(event)
        return sorted(found, key=lambda e: (e["time"], e.get("step") or 0))

    async def tenants(self) -> list[str]:
        return sorted(
            m.decode() if isinstance(m, bytes) else str(m)
            for m in await self.redis.smembers(TENANTS_KEY)
        )

    async def act(self, tenant: str, who: str, action: str, target: str, outcome: str) -> None:
        """Record an action taken from the console (who did it, on what, and what came of it)."""
        entry = {"time": time.time(), "by": who, "action": action, "target": target}
        key = f"{prefix(tenant)}:actions"
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.lpush(key, json.dumps({**entry, "outcome": outcome}))
            pipe.ltrim(key, 0, 999)
            pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def actions(self, tenant: str, limit: int = 200) -> list[dict[str, Any]]:
        raw = await self.redis.lrange(f"{prefix(tenant)}:actions", 0, limit - 1)
        return [json.loads(item) for item in raw]
