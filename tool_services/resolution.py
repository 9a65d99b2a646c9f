"""What one tool call delivery comes to (steps 1 to 3 of ``tool_services.server``): the reply to
send, or a ``Verdict`` (drop it, give it back).

A body that does not decode is answered with an ``error`` where it can be, a call past its
deadline is dropped unrun, and a call is claimed by its idempotency key under one of the
instance's ``concurrency`` slots: it runs (``OwnedCall``), or is answered from its stored reply,
or waits for the instance running it elsewhere, or gets ``unknown`` when that instance died
while running a tool that is not idempotent.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from typing import Any

from aio_pika.abc import AbstractIncomingMessage
from redis.asyncio import Redis

from contracts import tenancy
from contracts.codec import DecodeError, decode
from contracts.tools import ToolCallRequest, idempotency_key
from tool_services.calls import CallStore, ClaimKind
from tool_services.execute import encode_reply, error_reply, undecodable_reply
from tool_services.metrics import ToolServiceMetrics
from tool_services.owned import OwnedCall, answer_orphan, readdressed
from tool_services.sdk import Tool, ToolService
from tool_services.settings import ToolServiceSettings

log = logging.getLogger("loopwire.tool_services")


class Verdict(enum.Enum):
    DROP = "drop"
    """Ack without a reply (deadline passed, or nobody to answer)."""
    REQUEUE = "requeue"
    """Give the delivery back to the broker (shutting down)."""


class CallResolver:
    """Resolves the deliveries of one ``ToolService``; ``bind`` gives it the call store once the
    server has connected, ``stopping`` makes it give every delivery not started back."""

    def __init__(
        self,
        service: ToolService,
        config: ToolServiceSettings,
        *,
        clock: Callable[[], float],
        metrics: ToolServiceMetrics,
    ) -> None:
        self.service = service
        self.config = config
        self.clock = clock
        self.metrics = metrics
        self.stopping = False
        self.slots = asyncio.Semaphore(config.concurrency)
        self.queued: set[asyncio.Task[Any]] = set()
        """Deliveries waiting for a free slot: handed back to the broker at once on stop."""
        self.calls: CallStore | None = None
        self.redis: Redis | None = None

    def bind(self, calls: CallStore, redis: Redis) -> None:
        self.calls = calls
        self.redis = redis

    async def process(self, message: AbstractIncomingMessage) -> bytes | Verdict:
        if self.stopping:
            return Verdict.REQUEUE
        try:
            request = decode(message.body, ToolCallRequest)
        except DecodeError as exc:
            log.warning(
                "undecodable tool call on %s (correlation id %r): %s",
                message.routing_key,
                message.correlation_id,
                exc.reason,
            )
            self.metrics.skipped(message.routing_key, "undecodable")
            if not message.reply_to:
                return Verdict.DROP
            return undecodable_reply(message.correlation_id, exc.reason) or Verdict.DROP
        tool = self.service.tools.get(request.tool)
        if tool is None:
            self.metrics.skipped(request.tool, "unknown_tool")
            return encode_reply(
                error_reply(request.call_id, f"this service does not serve tool {request.tool!r}")
            )
        if self._expired(request):
            log.warning(
                "dropping call %s of %s: its deadline passed %.3fs ago",
                request.call_id,
                tool.name,
                self.clock() - request.context.deadline,
            )
            self.metrics.skipped(tool.name, "expired")
            return Verdict.DROP
        with tenancy.acting_for(request.context.tenant):  # its session-scoped keys
            return await self._resolve(request, tool)

    def _expired(self, request: ToolCallRequest) -> bool:
        return self.clock() >= request.context.deadline

    async def _resolve(self, request: ToolCallRequest, tool: Tool) -> bytes | Verdict:
        """Claim the call and run it, or answer from (or wait for) its stored reply."""
        calls = self.calls
        assert calls is not None
        key = request.context.idempotency_key or idempotency_key(
            request.context.turn_id, request.call_id
        )
        try:
            while True:
                if not await self._acquire_slot():
                    return Verdict.REQUEUE
                try:
                    if self._expired(request):
                        log.warning(
                            "dropping call %s: deadline passed while it waited", request.call_id
                        )
                        self.metrics.skipped(tool.name, "expired")
                        return Verdict.DROP
                    claim = await calls.claim(key, idempotent=tool.idempotent)
                    if claim.owns:
                        assert self.redis is not None
                        return await OwnedCall(
                            request, tool, claim, calls=calls, redis=self.redis
                        ).run(
                            metrics=self.metrics,
                            clock=self.clock,
                            lease_refresh_s=self.config.lease_refresh_s,
                        )
                finally:
                    self.slots.release()
                if claim.kind is ClaimKind.DONE:
                    assert claim.reply is not None
                    log.info("call %s (%s) answered from its stored reply", request.call_id, key)
                    self.metrics.skipped(tool.name, "replayed")
                    return readdressed(claim.reply, request.call_id)
                if claim.kind is ClaimKind.ORPHANED:
                    self.metrics.skipped(tool.name, "orphaned")
                    return await answer_orphan(request, tool, claim, calls)
                await asyncio.sleep(self.config.duplicate_poll_s)
        except Exception as exc:  # Redis unreachable: answer instead of losing the call
            log.exception("cannot check call %s against its stored reply", request.call_id)
            self.metrics.skipped(tool.name, "store_unavailable")
            return encode_reply(
                error_reply(request.call_id, f"the tool service cannot reach its store: {exc}")
            )

    async def _acquire_slot(self) -> bool:
        """Wait for one of the ``concurrency`` slots; False when the service is stopping."""
        task = asyncio.current_task()
        if task is not None:
            self.queued.add(task)
        try:
            if self.stopping:
                return False
            await self.slots.acquire()
        finally:
            if task is not None:
                self.queued.discard(task)
        if self.stopping:
            self.slots.release()
            return False
        return True
