"""The memory service's scopes within a tenant (``tool_services.memory``,
``worker.session.memories``): a memory's id, the tenant each statement names, the routing key
of ``memory.updated``; with tenancy off every one of them is what it was before tenants."""

from __future__ import annotations

import hashlib
from typing import Any

import asyncpg
import pytest

from contracts import tenancy
from contracts.memory_table import FORGET_SESSION, FORGET_SESSION_UNTENANTED, tenant
from tool_services.memory.service import Memory, MemorySettings, memory_id
from tool_services.sdk import CallContext
from worker.session.memories import SessionMemories


def test_off_and_for_the_default_tenant_a_memory_keeps_its_id_and_rows() -> None:
    before_tenants = hashlib.sha256(b"user\0u1\0t1:c1").hexdigest()[:24]
    assert memory_id("user", "u1", "t1:c1") == before_tenants
    assert tenant() == tenancy.DEFAULT
    with tenancy.acting_for(tenancy.DEFAULT):
        assert memory_id("user", "u1", "t1:c1") == before_tenants
        assert tenant() == tenancy.DEFAULT


def test_two_tenants_remembering_the_same_call_store_two_memories() -> None:
    with tenancy.acting_for("acme"):
        acme = memory_id("user", "u1", "t1:c1")
        assert tenant() == "acme"
    with tenancy.acting_for("globex"):
        globex = memory_id("user", "u1", "t1:c1")
    assert len({acme, globex, memory_id("user", "u1", "t1:c1")}) == 3


class Pool:
    """Answers ``execute`` as asyncpg's pool does, or raises ``fails`` the first time."""

    def __init__(self, fails: Exception | None = None) -> None:
        self.fails = fails
        self.statements: list[tuple[Any, ...]] = []

    async def execute(self, *args: Any) -> str:
        self.statements.append(args)
        if self.fails is not None:
            fails, self.fails = self.fails, None
            raise fails
        return "DELETE 2"


def memories(pool: Pool) -> SessionMemories:
    forgetting = SessionMemories("postgresql://unused")
    forgetting._pool = pool  # type: ignore[assignment]
    return forgetting


@pytest.mark.parametrize("acting_for", [None, tenancy.DEFAULT, "acme"])
async def test_a_deleted_session_forgets_its_tenants_memories_only(
    acting_for: str | None,
) -> None:
    pool = Pool()
    with tenancy.acting_for(acting_for):
        assert await memories(pool).forget("s1") == 2
    assert pool.statements == [(FORGET_SESSION, "s1", acting_for or tenancy.DEFAULT)]


async def test_a_table_from_before_tenants_is_the_default_tenants() -> None:
    pool = Pool(fails=asyncpg.UndefinedColumnError('column "tenant" does not exist'))
    assert await memories(pool).forget("s1") == 2
    assert pool.statements[-1] == (FORGET_SESSION_UNTENANTED, "s1")
    pool = Pool(fails=asyncpg.UndefinedColumnError('column "tenant" does not exist'))
    with tenancy.acting_for("acme"):
        assert await memories(pool).forget("s1") == 0
    assert len(pool.statements) == 1


class Exchange:
    def __init__(self) -> None:
        self.routing_keys: list[str] = []

    async def publish(self, message: Any, routing_key: str) -> None:
        self.routing_keys.append(routing_key)


class Channel:
    def __init__(self) -> None:
        self.exchange = Exchange()

    async def get_exchange(self, name: str, ensure: bool = True) -> Exchange:
        return self.exchange


async def test_memory_updated_is_published_within_the_calls_tenant() -> None:
    memory = Memory(MemorySettings())
    channel = Channel()
    memory._channel = channel  # type: ignore[assignment]
    ctx = CallContext(
        call_id="c1",
        tool="remember",
        session_id="s1",
        turn_id="t1",
        agent="support",
        metadata={},
        deadline=0.0,
        idempotency_key="t1:c1",
        redis=None,  # type: ignore[arg-type]
    )
    await memory.announce(ctx, "session", "m1", "remembered")
    with tenancy.acting_for("acme"):
        await memory.announce(ctx, "session", "m1", "forgotten")
    off, acme = channel.exchange.routing_keys
    assert off.startswith("memory.updated.support.t1")
    assert acme == f"acme.{off}"
    await memory.close()
