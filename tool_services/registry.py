"""Discovery, the tool service's side: each instance announces its tools in Redis
(``contracts.registry`` reads the live ones).

Each instance writes ``HSET keys.tool_registry() <instance_id> <msgpack
ToolAnnouncement>`` when it starts and every ``announce_interval_s``, with
``expires_at = now + announce_ttl_s``, and ``HDEL``s its field on a clean
shutdown. An instance that died simply stops refreshing: its announcement
expires and its tools are no longer offered. An instance whose AMQP connection
is down skips its heartbeat for the same reason.

Nothing of a dead instance stays: every heartbeat also removes the expired announcements of
others (as every worker's read does, ``live_tools``), and keeps the hash itself alive at least
``announce_ttl_s`` more (a longer expiry stays), so once no instance announces any more the
hash is gone too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Final

from redis.asyncio import Redis

from contracts import keys
from contracts.codec import encode
from contracts.registry import live_tools
from contracts.tools import ToolAnnouncement, ToolDefinition

__all__ = ["Announcer", "live_tools"]

log = logging.getLogger("loopwire.tool_services")

# KEYS: registry ; ARGV: instance_id, announcement, ttl_s: the hash lives at least ttl_s more
_ANNOUNCE: Final = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local t = redis.call('TTL', KEYS[1])
if t == -1 or t < tonumber(ARGV[3]) then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
return 1
"""


class Announcer:
    """Keeps one instance's announcement fresh until stopped."""

    def __init__(
        self,
        redis: Redis,
        *,
        service: str,
        instance_id: str,
        tools: Sequence[ToolDefinition],
        interval_s: float,
        ttl_s: float,
        healthy: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.service = service
        self.instance_id = instance_id
        self.tools = tuple(tools)
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.healthy = healthy
        self.clock = clock
        self._task: asyncio.Task[None] | None = None
        self._announce = redis.register_script(_ANNOUNCE)

    async def announce(self) -> None:
        now = self.clock()
        announcement = ToolAnnouncement(
            service=self.service,
            instance_id=self.instance_id,
            tools=self.tools,
            announced_at=now,
            expires_at=now + self.ttl_s,
        )
        await self._announce(
            keys=[keys.tool_registry()],
            args=[self.instance_id, encode(announcement), math.ceil(self.ttl_s)],
        )
        await live_tools(self.redis, now)  # which removes the expired announcements of others

    async def start(self) -> None:
        """Announce now (failing loudly) and keep announcing in the background."""
        await self.announce()
        self._task = asyncio.create_task(self._run(), name=f"announce:{self.instance_id}")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.healthy():
                log.warning("not announcing %s: the broker connection is down", self.instance_id)
                continue
            try:
                await self.announce()
            except Exception as exc:
                log.warning("announcing %s failed: %s", self.instance_id, exc)

    async def stop(self) -> None:
        """Stop the heartbeat and withdraw the announcement."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            await self.redis.hdel(keys.tool_registry(), self.instance_id)
        except Exception as exc:
            log.warning("withdrawing the announcement of %s failed: %s", self.instance_id, exc)
