"""Threads the gateway created, in Redis beside their sessions (``contracts.keys``:
``session_thread``, ``thread_index``), so that any replica answers for any thread and a restart
loses nothing. A thread's record holds what a session does not: when the client created it and
its metadata. A session that a client of the queue started is a thread too (created when its
first turn was; no metadata). Each call runs acting for the request's tenant, so the keys are
that tenant's."""

from __future__ import annotations

import json
import time
from typing import Any

from redis.asyncio import Redis

from contracts import keys

SEARCH_SCAN = 1000
"""Newest threads a search with a metadata filter reads at most."""


class Threads:
    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self.redis = redis
        self.ttl_s = ttl_s

    async def create(self, thread_id: str, metadata: dict[str, Any]) -> dict[str, Any] | None:
        """The new thread's record, or None when it exists already."""
        now = time.time()
        record = {"created_at": now, "metadata": metadata}
        key = keys.session_thread(thread_id)
        written = await self.redis.hsetnx(key, "record", json.dumps(record))
        if not written:
            return None
        await self.redis.expire(key, self.ttl_s)
        await self.redis.zadd(keys.thread_index(), {thread_id: now})
        return record

    async def get(self, thread_id: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(keys.session_thread(thread_id), "record")
        return json.loads(raw) if raw else None

    async def touch(self, thread_id: str) -> None:
        """Keep the record as long as its session (a run started in it)."""
        await self.redis.expire(keys.session_thread(thread_id), self.ttl_s)

    async def forget(self, thread_id: str) -> bool:
        deleted = await self.redis.delete(keys.session_thread(thread_id))
        await self.redis.zrem(keys.thread_index(), thread_id)
        return bool(deleted)

    async def search(
        self, metadata: dict[str, Any], limit: int, offset: int
    ) -> list[tuple[str, dict[str, Any]]]:
        """Threads whose metadata has every item of ``metadata``, newest first, among the
        ``SEARCH_SCAN`` newest of the tenant."""
        index = keys.thread_index()
        found: list[tuple[str, dict[str, Any]]] = []
        for raw_id in await self.redis.zrevrange(index, 0, SEARCH_SCAN - 1):
            thread_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
            record = await self.get(thread_id)
            if record is None:  # expired or erased: dropped from the index
                await self.redis.zrem(index, thread_id)
            elif all(record["metadata"].get(k) == v for k, v in metadata.items()):
                found.append((thread_id, record))
            if len(found) >= offset + limit:
                break
        return found[offset : offset + limit]
