"""Where memories live: one PostgreSQL table that every instance of the service shares.

PostgreSQL, because a platform team runs it already (backups, replicas, access control), it
is transactional (a memory is written once per call, ``ON CONFLICT DO NOTHING`` on an id
derived from the call's idempotency key, so a retried or redone call does not remember twice),
and a killed instance loses nothing the database confirmed. Vectors are ``real[]`` columns
(unit vectors), and recall ranks a scope's memories by their dot product with the query's
vector in SQL: exact search, linear in the scope's memories, which suits memories kept per
session, user or agent. Where the pgvector extension is installed, its ``vector`` type and an
HNSW index are the drop-in for scopes of millions (docs/memory.md).

Every row names its tenant (``tenant``), and every statement takes the tenant it reads or
changes (``contracts.memory_table.tenant``), so one tenant's ``user`` memories of user ``u1``
are not another's. A table from before tenants gets the column on the first connect, with
``default`` for its rows (what tenancy off and the tenant ``default`` read), and the index on
``(scope, owner)`` becomes one on ``(scope, owner, tenant)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import asyncpg

from contracts.memory_table import TABLE

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    id text PRIMARY KEY,
    scope text NOT NULL,
    owner text NOT NULL,
    text text NOT NULL,
    tags text[] NOT NULL DEFAULT '{{}}',
    embedding real[] NOT NULL,
    created_at double precision NOT NULL,
    tenant text NOT NULL DEFAULT 'default'
);
ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS tenant text NOT NULL DEFAULT 'default';
CREATE INDEX IF NOT EXISTS {TABLE}_owner_tenant ON {TABLE} (scope, owner, tenant);
DROP INDEX IF EXISTS {TABLE}_owner;
"""


@dataclass(frozen=True, slots=True)
class Recalled:
    id: str
    text: str
    tags: list[str]
    score: float
    created_at: float


class MemoryStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    @classmethod
    async def connect(cls, url: str) -> MemoryStore:
        pool = await asyncpg.create_pool(url, min_size=1, max_size=10, command_timeout=10)
        async with pool.acquire() as connection:
            await connection.execute("SELECT pg_advisory_lock(4711)")  # one schema change at a time
            try:
                await connection.execute(SCHEMA)
            finally:
                await connection.execute("SELECT pg_advisory_unlock(4711)")
        return cls(pool)

    async def remember(
        self,
        memory_id: str,
        scope: str,
        owner: str,
        text: str,
        tags: list[str],
        vector: list[float],
        tenant: str,
    ) -> bool:
        """Store a memory; ``False`` when one with that id was stored already."""
        status = await self.pool.execute(
            "INSERT INTO lw_memories (id, scope, owner, text, tags, embedding, created_at,"
            " tenant) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (id) DO NOTHING",
            memory_id,
            scope,
            owner,
            text,
            tags,
            vector,
            time.time(),
            tenant,
        )
        return bool(status.endswith(" 1"))

    async def recall(
        self, scope: str, owner: str, vector: list[float], k: int, tenant: str
    ) -> list[Recalled]:
        rows = await self.pool.fetch(
            "SELECT id, text, tags, created_at,"
            " (SELECT coalesce(sum(a * b), 0) FROM unnest(embedding, $3::real[]) AS t(a, b))"
            " AS score FROM lw_memories WHERE scope = $1 AND owner = $2 AND tenant = $5"
            " ORDER BY score DESC, created_at DESC LIMIT $4",
            scope,
            owner,
            vector,
            k,
            tenant,
        )
        return [
            Recalled(r["id"], r["text"], list(r["tags"]), float(r["score"]), r["created_at"])
            for r in rows
        ]

    async def forget(self, memory_id: str, scope: str, owner: str, tenant: str) -> bool:
        status = await self.pool.execute(
            "DELETE FROM lw_memories WHERE id = $1 AND scope = $2 AND owner = $3 AND tenant = $4",
            memory_id,
            scope,
            owner,
            tenant,
        )
        return bool(status.endswith(" 1"))

    async def forget_owner(self, scope: str, owner: str, tenant: str) -> int:
        status = await self.pool.execute(
            "DELETE FROM lw_memories WHERE scope = $1 AND owner = $2 AND tenant = $3",
            scope,
            owner,
            tenant,
        )
        return int(status.split()[-1])

    async def close(self) -> None:
        await self.pool.close()
