"""A deleted session's memories, forgotten in the memory service's database (the session's
deletion, ``worker.sequencing.erasure``, calls ``forget``).

Only the memories of the tenant the deletion acts for (``contracts.memory_table.tenant``):
a session id is unique within its tenant only, so another tenant's session of the same id
keeps its memories.
"""

from __future__ import annotations

import asyncio

import asyncpg

from contracts import tenancy
from contracts.memory_table import FORGET_SESSION, FORGET_SESSION_UNTENANTED, tenant


class SessionMemories:
    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self._pool: asyncpg.Pool | None = None
        self._lock = asyncio.Lock()

    async def forget(self, session_id: str) -> int:
        """Forget the session's memories; the number forgotten (0 before the table exists)."""
        async with self._lock:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(
                    self.database_url, min_size=0, max_size=2, command_timeout=10
                )
        whose = tenant()
        try:
            status = await self._pool.execute(FORGET_SESSION, session_id, whose)
        except asyncpg.UndefinedTableError:
            return 0
        except asyncpg.UndefinedColumnError:  # a table from before tenants: all default's
            if whose != tenancy.DEFAULT:
                return 0
            status = await self._pool.execute(FORGET_SESSION_UNTENANTED, session_id)
        return int(status.split()[-1])

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
