"""The ``memory`` tools: ``remember``, ``recall`` and ``forget``, scoped per session, per
user or per agent, over embeddings from an OpenAI-compatible ``/embeddings`` endpoint and a
store every instance shares (``tool_services.memory.store``: PostgreSQL).

- ``scope`` is ``session`` (the turn's session), ``user`` (the turn's ``metadata.user_id``)
  or ``agent`` (the turn's agent); a call sees and forgets only its own scope's memories.
- ``remember`` is idempotent per call: the memory's id derives from the call's idempotency
  key, so a call redone after a crash stores one memory.
- ``recall`` answers ``{"results": [...]}``, so the loop's empty-streak guard judges it.
- Every change is announced as ``memory.updated`` on ``loopwire.events`` (scope, memory id,
  ``remembered`` or ``forgotten``; never the text), under the call's tenant's routing key.
- Every scope is the call's tenant's (``tenancy.current()``, from the call's
  ``context.tenant``): the store keeps a ``tenant`` with each memory and reads and forgets
  within it, and a memory's id derives from its tenant too (``memory_id``). With tenancy off,
  and for the tenant ``default``, ids, rows and answers are what they were before tenants.

Configuration: ``LOOPWIRE_MEMORY__DATABASE_URL`` (``postgresql://…``),
``LOOPWIRE_MEMORY__EMBEDDINGS_URL`` (``http://…/v1``), ``LOOPWIRE_MEMORY__EMBEDDINGS_MODEL``,
and the key in ``LOOPWIRE_MEMORY__API_KEY`` (docs/memory.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from typing import Any, Literal

import aio_pika
from openai import AsyncOpenAI
from pydantic import BaseModel, ConfigDict, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from contracts import tenancy
from contracts import topology as t
from contracts.codec import encode
from contracts.events import MemoryUpdated, make_event
from contracts.memory_table import tenant
from contracts.runtime import amqp
from contracts.runtime.tls import TlsFiles, TlsSettings
from tool_services.memory.store import MemoryStore
from tool_services.sdk import CallContext, ToolError, ToolResult, ToolService

log = logging.getLogger("loopwire.tool_services.memory")

Scope = Literal["session", "user", "agent"]
EVENT_SOURCE = "/loopwire/tool_services/memory"


class MemorySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOPWIRE_MEMORY__", extra="ignore")

    database_url: str = Field(default="postgresql://postgres@127.0.0.1:5432/postgres")
    embeddings_url: str = Field(default="http://127.0.0.1:8099/v1")
    embeddings_model: str = Field(default="text-embedding-3-small")
    api_key: SecretStr = Field(default=SecretStr("not-needed"))
    amqp_url: str = Field(
        default="amqp://guest:guest@127.0.0.1:5672/",
        validation_alias="LOOPWIRE_AMQP_URL",
        description="Where memory.updated events go (the service's broker).",
    )
    amqp_urls: str = Field(
        default="",
        validation_alias="LOOPWIRE_AMQP_URLS",
        description="The broker's nodes, comma-separated (failover); used instead of amqp_url.",
    )
    amqp_tls: TlsFiles = Field(
        default_factory=lambda: TlsSettings().amqp_tls,
        description="The broker's TLS files, from LOOPWIRE_AMQP_TLS__* as every process's.",
    )


class RememberArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, max_length=8000, description="What to remember.")
    scope: Scope = Field(default="session", description="Whose memory: session, user or agent.")
    tags: list[str] = Field(default_factory=list, max_length=10)


class RecallArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=2000, description="What to look for.")
    scope: Scope = "session"
    k: int = Field(default=5, ge=1, le=50, description="How many memories at most.")


class ForgetArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=64, description="The memory's id (from recall).")
    scope: Scope = "session"


class Memory:
    """The service's connections, opened on the first call (the factory runs before the event
    loop does) and closed at shutdown."""

    def __init__(self, settings: MemorySettings) -> None:
        self.settings = settings
        self._store: MemoryStore | None = None
        self._embeddings = AsyncOpenAI(
            base_url=settings.embeddings_url,
            api_key=settings.api_key.get_secret_value(),
            timeout=30,
            max_retries=2,
        )
        self._events: aio_pika.abc.AbstractRobustConnection | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._lock = asyncio.Lock()

    async def store(self) -> MemoryStore:
        async with self._lock:
            if self._store is None:
                self._store = await MemoryStore.connect(self.settings.database_url)
            return self._store

    async def embed(self, text: str) -> list[float]:
        answer = await self._embeddings.embeddings.create(
            model=self.settings.embeddings_model, input=text
        )
        vector = [float(v) for v in answer.data[0].embedding]
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        return [v / norm for v in vector]

    async def announce(
        self,
        ctx: CallContext,
        scope: Scope,
        memory_id: str,
        action: Literal["remembered", "forgotten"],
    ) -> None:
        try:
            async with self._lock:
                if self._channel is None:
                    self._events = await amqp.connect(
                        amqp.resolve_urls(self.settings.amqp_url, self.settings.amqp_urls),
                        name="loopwire-memory-events",
                        tls=self.settings.amqp_tls,
                    )
                    self._channel = await self._events.channel(publisher_confirms=True)
            event = make_event(
                "memory.updated",
                MemoryUpdated(scope=scope, memory_id=memory_id, action=action),
                agent=ctx.agent,
                time=time.time(),
                turn_id=ctx.turn_id,
                session_id=ctx.session_id,
                call_id=f"{memory_id}:{action}",
            ).model_copy(update={"source": EVENT_SOURCE})
            exchange = await self._channel.get_exchange(t.EVENTS_EXCHANGE, ensure=False)
            await exchange.publish(
                aio_pika.Message(
                    encode(event), content_type=t.CONTENT_TYPE, headers=dict(event.headers())
                ),
                routing_key=tenancy.routed(event.routing_key),
            )
        except Exception:  # events only observe: the memory is stored either way
            log.exception("could not announce memory %s %s", memory_id, action)

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()
        if self._events is not None:
            await self._events.close()
        await self._embeddings.close()


def owner_of(scope: Scope, ctx: CallContext) -> str:
    if scope == "session":
        return ctx.session_id
    if scope == "agent":
        return ctx.agent
    user = ctx.metadata.get("user_id")
    if not isinstance(user, str) or not user:
        raise ToolError("scope 'user' needs the turn's metadata.user_id")
    return user


def memory_id(scope: Scope, owner: str, idempotency_key: str) -> str:
    """The id of the memory a call remembers: the same call, the same id, so a redone call
    stores one memory; for a tenant other than ``default`` the tenant is part of it."""
    key = f"{scope}\0{owner}\0{idempotency_key}"
    whose = tenant()
    if whose != tenancy.DEFAULT:
        key = f"{whose}\0{key}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def create_service(settings: MemorySettings | None = None) -> ToolService:
    memory = Memory(settings or MemorySettings())
    service = ToolService("memory")

    async def remember(args: RememberArgs, ctx: CallContext) -> ToolResult:
        owner = owner_of(args.scope, ctx)
        new_id = memory_id(args.scope, owner, ctx.idempotency_key)
        vector = await memory.embed(args.text)
        store = await memory.store()
        if await store.remember(new_id, args.scope, owner, args.text, args.tags, vector, tenant()):
            await memory.announce(ctx, args.scope, new_id, "remembered")
        return ToolResult(value={"remembered": True, "id": new_id, "scope": args.scope})

    async def recall(args: RecallArgs, ctx: CallContext) -> dict[str, Any]:
        owner = owner_of(args.scope, ctx)
        vector = await memory.embed(args.query)
        found = await (await memory.store()).recall(args.scope, owner, vector, args.k, tenant())
        return {
            "results": [
                {"id": m.id, "text": m.text, "tags": m.tags, "score": round(m.score, 4)}
                for m in found
            ]
        }

    async def forget(args: ForgetArgs, ctx: CallContext) -> dict[str, Any]:
        owner = owner_of(args.scope, ctx)
        gone = await (await memory.store()).forget(args.id, args.scope, owner, tenant())
        if gone:
            await memory.announce(ctx, args.scope, args.id, "forgotten")
        return {"forgotten": gone, "id": args.id}

    service.add_tool(
        remember,
        description="Remember a fact for later turns (scope: this session, the user, or the agent).",
        timeout_s=30,
        idempotent=True,
    )
    service.add_tool(
        recall,
        description="Recall what was remembered that is closest to the query.",
        timeout_s=30,
        idempotent=True,
    )
    service.add_tool(forget, description="Forget one memory by its id.", timeout_s=30)
    service.on_shutdown(memory.close)
    return service
