"""The tools workers may offer: those announced by a live tool service (cached briefly).

Tool services write a ``ToolAnnouncement`` per instance into the Redis hash
``keys.tool_registry()`` on every heartbeat (``tool_services.registry``); an
announcement past its ``expires_at`` means the instance is gone, and its tools
are no longer offered to the model. A call the model made while the tool was offered is still
sent when its step is redone (``last_known``): a tool service answers a repeated call from its
stored reply, so an outage that hid the announcement must not turn a call that ran into an
error.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from redis.asyncio import Redis

from contracts.registry import live_tools
from contracts.tools import ToolDefinition


class RegistryCatalog:
    """``ToolCatalog`` over the Redis tool registry; remembers every definition it has seen."""

    def __init__(self, redis: Redis, *, cache_s: float = 1.0) -> None:
        self.redis = redis
        self.cache_s = cache_s
        self._cached: list[ToolDefinition] = []
        self._known: dict[str, ToolDefinition] = {}
        self._at = float("-inf")

    async def available(self) -> Sequence[ToolDefinition]:
        now = time.monotonic()
        if now - self._at > self.cache_s:
            live = await live_tools(self.redis)
            self._known.update(live)
            self._cached = list(live.values())
            self._at = now
        return self._cached

    def last_known(self, name: str) -> ToolDefinition | None:
        return self._known.get(name)
