"""A call this instance claimed: run it under a renewed lease, store the reply, send it.

And the answers for calls it may not run: a stored reply (re-addressed to the
request's call id) and ``unknown`` for an interrupted non-idempotent call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from redis.asyncio import Redis

from contracts.codec import DecodeError, decode
from contracts.tools import ToolCallReply, ToolCallRequest
from tool_services.calls import CallStore, Claim, ClaimKind
from tool_services.execute import encode_reply, error_reply, execute_tool
from tool_services.metrics import ToolServiceMetrics
from tool_services.sdk import CallContext, Tool

log = logging.getLogger("loopwire.tool_services")

STORE_PATIENCE_S = 30.0
"""How long past a call's deadline its reply is still tried to be stored while Redis is away."""


class OwnedCall:
    """One call whose claim this instance holds."""

    def __init__(
        self,
        request: ToolCallRequest,
        tool: Tool,
        claim: Claim,
        *,
        calls: CallStore,
        redis: Redis,
    ) -> None:
        self.request = request
        self.tool = tool
        self.claim = claim
        self.calls = calls
        self.redis = redis

    async def run(
        self,
        *,
        metrics: ToolServiceMetrics,
        clock: Callable[[], float],
        lease_refresh_s: float,
    ) -> bytes:
        """Run the tool and return the reply to send (the stored one if another got there)."""
        request, tool, claim, calls = self.request, self.tool, self.claim, self.calls
        if claim.kind is ClaimKind.TAKEOVER:
            log.warning(
                "call %s of %s: owner %s died, running it again",
                request.call_id,
                tool.name,
                claim.owner,
            )
        ctx = CallContext(
            call_id=request.call_id,
            tool=tool.name,
            session_id=request.context.session_id,
            turn_id=request.context.turn_id,
            agent=request.context.agent,
            metadata=request.context.metadata,
            deadline=request.context.deadline,
            idempotency_key=claim.key,
            redis=self.redis,
            takeover=claim.kind is ClaimKind.TAKEOVER,
            state=request.context.state,
        )
        keeper = asyncio.create_task(self._keep_lease(lease_refresh_s), name=f"lease:{claim.key}")
        started = time.monotonic()
        try:
            try:
                with metrics.in_progress.labels(tool.name).track_inprogress():
                    reply, outcome = await execute_tool(tool, request, ctx, clock=clock)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await asyncio.shield(calls.release(claim, forget_owner=tool.idempotent))
                raise
            elapsed = time.monotonic() - started
            metrics.ran(tool.name, outcome, elapsed)
            log.info(
                "call %s of %s: %s in %.3fs", request.call_id, tool.name, reply.status, elapsed
            )
            body = encode_reply(reply)
            earlier = await self._store(body, reply.status, clock)
        finally:
            keeper.cancel()
        if earlier is not None:
            log.warning("call %s already had a stored reply; sending that one", request.call_id)
            return readdressed(earlier, request.call_id)
        return body

    async def _store(self, body: bytes, status: str, clock: Callable[[], float]) -> bytes | None:
        """Store the reply, trying again while Redis is away (the call's lease is kept alive
        meanwhile) until ``STORE_PATIENCE_S`` past the call's deadline: a reply that is not
        stored would make the call look interrupted to a worker that sends it again, and a
        non-idempotent call that ran would be answered ``unknown``. Then it is sent unstored.
        Returns a reply stored earlier by another instance, if there was one."""
        give_up = self.request.context.deadline + STORE_PATIENCE_S
        delay = 0.1
        while True:
            try:
                earlier = await self.calls.store(
                    self.claim.key, body, status, token=self.claim.token
                )
                return earlier
            except Exception as exc:
                if clock() + delay > give_up:
                    log.exception(
                        "could not store the reply of call %s; sending it unstored",
                        self.request.call_id,
                    )
                    return None
                log.warning(
                    "could not store the reply of call %s yet (%s); trying again",
                    self.request.call_id,
                    exc,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _keep_lease(self, refresh_s: float) -> None:
        claim = self.claim
        while True:
            await asyncio.sleep(refresh_s)
            try:
                if not await self.calls.refresh(claim):
                    log.warning("lost the lease of call %s to another instance", claim.key)
                    return
            except Exception as exc:
                log.warning("could not renew the lease of call %s: %s", claim.key, exc)


async def answer_orphan(
    request: ToolCallRequest, tool: Tool, claim: Claim, calls: CallStore
) -> bytes:
    """``unknown`` for a non-idempotent call whose owner died while running it."""
    log.warning(
        "call %s of non-idempotent %s was interrupted (owner %s died): replying unknown",
        request.call_id,
        tool.name,
        claim.owner,
    )
    reply = encode_reply(
        error_reply(
            request.call_id,
            f"the tool {tool.name!r} was interrupted while running; it may or may not have "
            "taken effect, and it is not idempotent, so it was not run again",
            status="unknown",
        )
    )
    earlier = await calls.store(claim.key, reply, "unknown")
    return readdressed(earlier, request.call_id) if earlier is not None else reply


def readdressed(stored: bytes, call_id: str) -> bytes:
    """A stored reply, addressed to this request's call id (a new worker may use another)."""
    try:
        reply = decode(stored, ToolCallReply)
    except DecodeError as exc:
        return encode_reply(error_reply(call_id, f"the stored reply is unreadable: {exc.reason}"))
    if reply.call_id == call_id:
        return stored
    return encode_reply(reply.model_copy(update={"call_id": call_id}))
