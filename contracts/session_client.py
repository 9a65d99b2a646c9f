"""``client.sessions``: a session's summary, history, turns, results and step records, and its
deletion, over the broker (``contracts.sessions``): reads go to ``loopwire.sessions`` and any
worker answers; a deletion goes to ``loopwire.turns`` and is answered once done."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractIncomingMessage, AbstractQueue

from contracts import topology as t
from contracts.base import Contract
from contracts.codec import DecodeError, decode, encode
from contracts.messages import ChatMessage
from contracts.sessions import SessionDelete, SessionQuery, SessionReply, SessionSummary, TurnInfo
from contracts.steps import StepExecution
from contracts.turns import TurnResult


class SessionError(Exception):
    """A session read or deletion was refused (``code``: ``not_found``, ``bad_request``)."""

    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(message)
        self.code = code


class Sessions:
    def __init__(
        self,
        channel: AbstractChannel,
        *,
        timeout_s: float = 30.0,
        exchange: AbstractExchange | None = None,
    ) -> None:
        self.channel = channel
        self.exchange = exchange or channel.default_exchange
        """Where reads and deletions are published (``contracts.publishing``)."""
        self.timeout_s = timeout_s
        self._queue: AbstractQueue | None = None
        self._waiting: dict[str, asyncio.Future[SessionReply]] = {}
        self._lock = asyncio.Lock()

    async def get(self, session_id: str) -> SessionSummary | None:
        """The session's summary, or ``None`` when there is no such session."""
        reply = await self._read(SessionQuery(op="get", session_id=session_id), missing_ok=True)
        return reply.summary

    async def history(
        self, session_id: str, *, offset: int = 0, limit: int = 100, newest_first: bool = False
    ) -> tuple[list[ChatMessage], int]:
        """A page of the history (oldest first, or with ``newest_first`` newest first) and the
        history's length."""
        query = SessionQuery(
            op="history",
            session_id=session_id,
            offset=offset,
            limit=limit,
            newest_first=newest_first,
        )
        reply = await self._read(query)
        return list(reply.messages), reply.total or 0

    async def turns(self, session_id: str) -> list[TurnInfo]:
        reply = await self._read(SessionQuery(op="turns", session_id=session_id))
        return list(reply.turns)

    async def result(self, turn_id: str, session_id: str | None = None) -> TurnResult | None:
        """A finished turn's result (kept for the state TTL), or ``None``."""
        query = SessionQuery(op="result", turn_id=turn_id, session_id=session_id)
        reply = await self._read(query, missing_ok=True)
        return reply.result

    async def turn(self, turn_id: str, session_id: str | None = None) -> TurnInfo | None:
        """A turn's status (``queued``, ``running``, ``waiting``, ``done`` with its
        ``finish_reason``), or ``None`` when no worker has accepted a turn of that id (or its
        records have expired)."""
        query = SessionQuery(op="turn", turn_id=turn_id, session_id=session_id)
        reply = await self._read(query, missing_ok=True)
        return reply.turns[0] if reply.turns else None

    async def text(self, session_id: str, turn_id: str, step: int) -> str | None:
        """The saved text of one step's answer, or ``None`` when it is not saved: what a
        subscriber that missed ``message.delta`` events reads once the step is saved (while the
        turn runs; for its last step, also after it ended)."""
        query = SessionQuery(op="text", session_id=session_id, turn_id=turn_id, step=step)
        reply = await self._read(query, missing_ok=True)
        return reply.text

    async def steps(
        self, turn_id: str, session_id: str | None = None, *, offset: int = 0, limit: int = 100
    ) -> list[StepExecution]:
        """A page of the records of a turn's completed steps, oldest first, from ``offset``:
        what each model call answered (usage, model, duration), each tool call's arguments and
        outcome, as the turn's step list keeps them (``StepExecution.stored``: messages and
        tool results the history holds are left out). Raises ``SessionError`` (``not_found``)
        for a turn no worker has accepted, or once its records have expired (``ttl_s`` past
        its end)."""
        query = SessionQuery(
            op="steps", turn_id=turn_id, session_id=session_id, offset=offset, limit=limit
        )
        reply = await self._read(query)
        return list(reply.steps)

    async def delete(
        self, session_id: str, *, reason: str = "deleted", by: str | None = None
    ) -> int:
        """Delete the session once its turns are cancelled; the number of Redis keys removed."""
        queue = await self._replies()
        order = SessionDelete(session_id=session_id, reason=reason, by=by, reply_to=queue.name)
        reply = await self._ask(
            order,
            f"delete:{session_id}",
            routing_key=t.TURNS_QUEUE,
            headers={t.H_KIND: t.KIND_SESSION_DELETE},
        )
        return reply.deleted_keys or 0

    async def _read(self, query: SessionQuery, *, missing_ok: bool = False) -> SessionReply:
        reply = await self._ask(query, uuid.uuid4().hex, routing_key=t.SESSIONS_QUEUE)
        if not reply.ok and not (missing_ok and reply.code == "not_found"):
            raise SessionError(reply.error or "refused", reply.code)
        return reply

    async def _ask(
        self,
        body: Contract,
        correlation_id: str,
        *,
        routing_key: str,
        headers: dict[str, Any] | None = None,
    ) -> SessionReply:
        queue = await self._replies()
        future: asyncio.Future[SessionReply] = asyncio.get_running_loop().create_future()
        self._waiting[correlation_id] = future
        try:
            await self.exchange.publish(
                aio_pika.Message(
                    encode(body),
                    content_type=t.CONTENT_TYPE,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    headers=headers or {},
                    correlation_id=correlation_id,
                    reply_to=queue.name,
                ),
                routing_key=routing_key,
            )
            return await asyncio.wait_for(future, self.timeout_s)
        finally:
            self._waiting.pop(correlation_id, None)

    async def _replies(self) -> AbstractQueue:
        async with self._lock:
            if self._queue is None:
                name = f"loopwire-client-sessions-{uuid.uuid4().hex[:12]}"
                self._queue = await self.channel.declare_queue(
                    name, exclusive=True, auto_delete=True
                )
                await self._queue.consume(self._on_reply, no_ack=True)
            return self._queue

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        future = self._waiting.get(message.correlation_id or "")
        if future is None or future.done():
            return
        try:
            future.set_result(decode(message.body, SessionReply))
        except DecodeError as exc:
            future.set_exception(SessionError(exc.reason, "bad_reply"))
