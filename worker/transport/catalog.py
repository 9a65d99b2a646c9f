"""The tools workers may offer: those announced by a live tool service (cached briefly).

Tool services write a ``ToolAnnouncement`` per instance into the Redis hash
``keys.tool_registry()`` on every heartbeat (``tool_services.registry``); an
announcement past its ``expires_at`` means the instance is gone, and its tools
are no longer offered, so a call to them fails at once as "tool unavailable".
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from redis.asyncio import Redis

from contracts.registry import live_tools
from contracts.tools import ToolDefinition


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
