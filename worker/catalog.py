"""The tools workers may offer: those announced by a live tool service (cached briefly).

Tool services write a ``ToolAnnouncement`` per instance into the Redis hash
``keys.tool_registry()`` on every heartbeat; an announcement past its
``expires_at`` means the instance is gone, and its tools are no longer offered.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from redis.asyncio import Redis

from contracts import keys
from contracts.codec import DecodeError, decode
from contracts.tools import ToolAnnouncement, ToolDefinition


async def live_announcements(redis: Redis, now: float | None = None) -> list[ToolAnnouncement]:
    """Unexpired announcements; expired or undecodable entries are removed."""
    now = time.time() if now is None else now
    entries = await redis.hgetall(keys.tool_registry())
    live: list[ToolAnnouncement] = []
    stale: list[bytes | str] = []
    for instance, blob in entries.items():
        try:
            announcement = decode(
                blob if isinstance(blob, bytes) else blob.encode(), ToolAnnouncement
            )
        except DecodeError:
            stale.append(instance)
            continue
        if announcement.expires_at < now:
            stale.append(instance)
        else:
            live.append(announcement)
    if stale:
        await redis.hdel(keys.tool_registry(), *stale)
    return live


async def live_tools(redis: Redis, now: float | None = None) -> dict[str, ToolDefinition]:
    """Tool name → definition, for every tool a live instance serves."""
    tools: dict[str, ToolDefinition] = {}
    for announcement in await live_announcements(redis, now):
        for definition in announcement.tools:
            tools.setdefault(definition.name, definition)
    return tools


class RegistryCatalog:
    """``ToolCatalog`` over the Redis tool registry."""

    def __init__(self, redis: Redis, *, cache_s: float = 1.0) -> None:
        self.redis = redis
        self.cache_s = cache_s
        self._cached: list[ToolDefinition] = []
        self._at = float("-inf")

    async def available(self) -> Sequence[ToolDefinition]:
        now = time.monotonic()
        if now - self._at > self.cache_s:
            self._cached = list((await live_tools(self.redis)).values())
            self._at = now
        return self._cached
