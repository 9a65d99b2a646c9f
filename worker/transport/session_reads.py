"""Session reads on the broker: every worker consumes ``loopwire.sessions`` and answers each
``SessionQuery`` with a ``SessionReply`` to its ``reply_to`` (its ``correlation_id`` kept).

A read takes no lease, so it never waits for a running turn, and reads what was last saved. A
query that cannot be read (not msgpack, not the schema) is dead-lettered with its reason like
any bad input, and, when it names a ``reply_to``, answered with ``ok: false`` and
``code: bad_request`` so that its publisher does not wait; a session or turn that does not
exist is ``ok: false``, ``code: not_found``, and so are a turn's step records once they have
expired (``ttl_s`` past its end; the error says so: a finished turn does not read as one with
no steps). Redis being away sends the query back to the queue (it is read again). While
tenancy is on, a query reads its tenant's sessions only (another tenant's are ``not_found``,
as if they did not exist); one whose tenant is refused (``worker.transport.tenants``) is
dead-lettered and answered with ``code: tenant_mismatch``. Each answer is counted
(``loopwire_session_reads_total{op, result}``, with the tenant when the metrics carry it): a
tenant naming sessions it does not have shows as its ``not_found``.
"""

from __future__ import annotations

import logging
import time
import uuid

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from contracts import keys, tenancy
from contracts import topology as t
from contracts.codec import DecodeError, decode
from contracts.sessions import SessionQuery, SessionReply
from worker.errors import PermanentError
from worker.runtime.metrics import WorkerMetrics
from worker.session.records import SessionRecords
from worker.transport.outbox import Outbox
from worker.transport.publish import Publisher, properties
from worker.transport.tenants import Tenants

log = logging.getLogger("loopwire.sessions")


async def answer(records: SessionRecords, query: SessionQuery) -> SessionReply:
    if query.op == "result":
        assert query.turn_id is not None
        result = await records.result(query.turn_id, query.session_id)
        if result is None:
            return _missing(f"no result for turn {query.turn_id}")
        return SessionReply(ok=True, result=result)
    if query.op == "turn":
        return await _turn(records, query)
    if query.op == "steps":
        return await _steps(records, query)
    assert query.session_id is not None
    if query.op == "text":
        assert query.turn_id is not None and query.step is not None
        text = await records.step_text(query.session_id, query.turn_id, query.step)
        if text is None:
            return _missing(f"no saved text for turn {query.turn_id} step {query.step}")
        return SessionReply(ok=True, text=text)
    summary = await records.summary(query.session_id)
    if summary is None:
        return _missing(f"no session {query.session_id}")
    if query.op == "get":
        return SessionReply(ok=True, summary=summary)
    if query.op == "turns":
        return SessionReply(ok=True, turns=tuple(await records.turns(query.session_id)))
    messages, total = await records.history(
        query.session_id, query.offset, query.limit, query.newest_first
    )
    return SessionReply(ok=True, messages=tuple(messages), total=total)


async def _turn(records: SessionRecords, query: SessionQuery) -> SessionReply:
    assert query.turn_id is not None
    session_id = await _session_of(records, query)
    if session_id:
        for info in await records.turns(session_id):
            if info.turn_id == query.turn_id:
                return SessionReply(ok=True, turns=(info,))
    return _missing(f"no turn {query.turn_id}")


async def _steps(records: SessionRecords, query: SessionQuery) -> SessionReply:
    assert query.turn_id is not None
    session_id = await _session_of(records, query)
    page = None
    if session_id:
        page = await records.steps(session_id, query.turn_id, query.offset, query.limit)
    if page is None:
        return _missing(f"no turn {query.turn_id}")
    if page.expired:
        return _missing(
            f"the step records of turn {query.turn_id} have expired "
            "(they are kept ttl_s past the turn's end)"
        )
    return SessionReply(ok=True, steps=page.records, total=page.total)


async def _session_of(records: SessionRecords, query: SessionQuery) -> str | None:
    """The query's session, or the one its turn was accepted into (while that is known)."""
    if query.session_id is not None or query.turn_id is None:
        return query.session_id
    found = await records.redis.get(keys.turn_session(query.turn_id))
    return found.decode() if isinstance(found, bytes) else found


class SessionReads:
    def __init__(
        self,
        records: SessionRecords,
        outbox: Outbox,
        dead_letters: Publisher,
        tenants: Tenants | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.records = records
        self.outbox = outbox
        self.dead_letters = dead_letters
        self.tenants = tenants if tenants is not None else Tenants()
        self.metrics = metrics if metrics is not None else WorkerMetrics(CollectorRegistry())

    async def handle(self, message: AbstractIncomingMessage) -> None:
        reply_to, correlation = message.reply_to, message.correlation_id or ""
        try:
            tenant = self.tenants.of(message.user_id, message.headers or {})
            query = decode(message.body, SessionQuery)
        except (DecodeError, PermanentError) as exc:
            reason, code = (
                (exc.reason, exc.code) if isinstance(exc, DecodeError) else (str(exc), exc.code)
            )
            await self._dead_letter(message, reason, code)
            code = "bad_request" if isinstance(exc, DecodeError) else code
            self.metrics.scoped(self.metrics.session_reads, "unread", code).inc()
            if reply_to:
                bad = SessionReply(ok=False, code=code, error=reason[:2000])
                await self.outbox.answer(reply_to, correlation, bad)
            await message.ack()
            return
        try:
            with tenancy.acting_for(tenant):  # the tenant's keys only: others' are not found
                reply = await answer(self.records, query)
                result = "ok" if reply.ok else reply.code or "error"
                self.metrics.scoped(self.metrics.session_reads, query.op, result).inc()
        except (RedisError, ConnectionError) as exc:
            log.warning("session read failed, it goes back to the queue: %s", exc)
            await message.nack(requeue=True)
            return
        if reply_to:
            await self.outbox.answer(reply_to, correlation, reply)
        await message.ack()

    async def _dead_letter(self, message: AbstractIncomingMessage, reason: str, code: str) -> None:
        log.warning("dead-lettering a session query (%s): %s", code, reason)
        await self.dead_letters.publish(
            message.body,
            routing_key=t.SESSIONS_QUEUE,
            properties=properties(
                content_type=message.content_type,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                headers={
                    **dict(message.headers or {}),
                    t.H_DEAD_ID: uuid.uuid4().hex[:16],
                    t.H_REASON: reason.replace("\n", " ")[:1000],
                    t.H_REASON_CODE: code,
                    t.H_REJECTED_AT: time.time(),
                },
                message_id=message.message_id,
                correlation_id=message.correlation_id,
                reply_to=message.reply_to,
            ),
        )


def _missing(error: str) -> SessionReply:
    return SessionReply(ok=False, code="not_found", error=error)
