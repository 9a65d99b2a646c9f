"""A session's history as it is stored (``contracts.keys.session_history``): a Redis list whose
items each hold one or more msgpack-encoded ``ChatMessage`` maps, in order (docs/protocol.md).
The workers' session reads and the HTTP gateway read it the same way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
from pydantic import TypeAdapter
from redis.asyncio import Redis

from contracts import keys
from contracts.messages import ChatMessage

_MESSAGES = TypeAdapter(list[ChatMessage])


def unpack(items: Sequence[bytes | str]) -> list[dict[str, Any]]:
    """Stored messages as plain data (each item holds one or more whole messages)."""
    out: list[dict[str, Any]] = []
    for item in items:
        data = item if isinstance(item, bytes) else item.encode()
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1))
        unpacker.feed(data)
        out.extend(unpacker)
    return out


async def read_history(redis: Redis, session_id: str) -> list[ChatMessage]:
    """The whole history of a session of the current tenant (empty when there is none)."""
    items = await redis.lrange(keys.session_history(session_id), 0, -1)
    return _MESSAGES.validate_python(unpack(items))
