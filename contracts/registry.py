"""The tool registry, as every reader sees it: which tools live tool service instances announce.

Each tool service instance keeps a ``ToolAnnouncement`` (msgpack) in the Redis hash
``keys.tool_registry()`` under its instance id, with ``expires_at`` in the future while it
lives (``tool_services.registry.Announcer`` writes it). Workers, the CLI and the demo read it
with ``live_tools(redis)``: a client with ``decode_responses=False`` (the default) is
expected; a decoding client works as long as the entries are valid UTF-8.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Final

from redis.asyncio import Redis

from contracts import keys
from contracts.codec import DecodeError, decode
from contracts.tools import ToolAnnouncement, ToolDefinition

log = logging.getLogger("loopwire.registry")

_DROP_IF_UNCHANGED: Final = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


async def live_tools(redis: Redis, now: float | None = None) -> dict[str, ToolDefinition]:
    """Tool name → definition for every tool announced by an unexpired instance.

    Expired and undecodable entries are removed (only if nobody rewrote them
    meanwhile). When instances disagree about a tool (a rolling deploy), the
    definition of the most recent announcement wins.
    """
    now = time.time() if now is None else now
    registry = keys.tool_registry()
    entries: dict[Any, Any] = await redis.hgetall(registry)
    newest: dict[str, tuple[float, ToolDefinition]] = {}
    stale: list[tuple[Any, Any]] = []
    for instance, blob in entries.items():
        raw = blob if isinstance(blob, bytes) else str(blob).encode()  # decode_responses=True
        try:
            announcement = decode(raw, ToolAnnouncement)
        except DecodeError:
            log.warning("dropping an undecodable tool announcement of %r", instance)
            stale.append((instance, blob))
            continue
        if announcement.expires_at <= now:
            stale.append((instance, blob))
            continue
        for definition in announcement.tools:
            seen = newest.get(definition.name)
            if seen is None or announcement.announced_at > seen[0]:
                newest[definition.name] = (announcement.announced_at, definition)
    if stale:
        drop = redis.register_script(_DROP_IF_UNCHANGED)
        for instance, blob in stale:
            await drop(keys=[registry], args=[instance, blob])
    return {name: definition for name, (_, definition) in sorted(newest.items())}
