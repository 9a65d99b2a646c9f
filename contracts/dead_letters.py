"""The dead-letter queue: list dead-lettered work with its reason, replay or purge a message
(``loopwire dlq`` and the console's dead-letters page, docs/console.md, both use this module).

Each message the worker dead-letters carries ``x-loopwire-dead-id`` (its id
here), ``x-loopwire-reason`` and ``x-loopwire-reason-code``; messages the broker
dead-lettered itself (delivery limit reached) are identified by their message id
or a hash of their body and show the broker's ``x-first-death-reason``.

Listing takes every message without acking and returns them all (nothing is
lost if the command dies: unacked messages go back to the queue). Purging acks the one letter
asked for (or every letter the caller sees) and puts the others back. Replaying
publishes the message to ``loopwire.turns`` without the dead-letter headers
(with a confirm) and only then removes it from the dead-letter queue. A letter a worker
vouched for (its ``user_id`` is the user the command logs in as: run it as the worker user)
keeps that ``user_id``, so a dead child turn's request or result is taken again
(``worker.transport.senders``); any other is replayed without one.

With a tenant (``loopwire --tenant NAME dlq ...``, docs/tenants.md) the command sees only the
letters whose ``x-loopwire-tenant`` header names that tenant (a publisher acting for it, or a
worker doing its work, stamped it), and a replay goes out vouched for as that tenant's: with
the user the command logs in as and the tenant's header, so a worker with tenancy on takes it
when that user is the tenant's or a trusted one.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from contracts import tenancy
from contracts import topology as t
from contracts.base import SAFE_ID_PATTERN
from contracts.codec import DecodeError, decode_obj
from contracts.runtime.amqp import connect, login, resolve_urls
from contracts.runtime.tls import TlsFiles

H_DEAD_ID = t.H_DEAD_ID
_DEAD_HEADERS = (
    t.H_REASON,
    t.H_REASON_CODE,
    H_DEAD_ID,
    t.H_REJECTED_AT,
    t.H_ATTEMPT,
    t.H_REDONE,
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-delivery-count",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
)


class NotReplayableError(Exception):
    """A dead letter that replaying would not run again; it stays where it is."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    id: str
    reason: str
    code: str
    turn_id: str | None
    kind: str
    size: int
    tenant: str | None = None
    """The tenant its ``x-loopwire-tenant`` header names, if any."""
    headers: dict[str, Any] | None = None
    """Its AMQP headers, as text (``list_dead(..., full=True)``)."""
    body: Any = None
    """Its body decoded from msgpack, or a note saying why it could not be (``full=True``)."""


def dead_id(message: AbstractIncomingMessage) -> str:
    headers = message.headers or {}
    if headers.get(H_DEAD_ID):
        return str(headers[H_DEAD_ID])
    if message.message_id:
        return str(message.message_id)
    return hashlib.sha1(message.body).hexdigest()[:16]


def describe(message: AbstractIncomingMessage, *, full: bool = False) -> DeadLetter:
    headers: dict[str, Any] = dict(message.headers or {})
    reason = str(headers.get(t.H_REASON) or headers.get("x-first-death-reason") or "unknown")
    code = str(headers.get(t.H_REASON_CODE) or "broker")
    turn_id = None
    body: Any = None
    tenant = headers.get(tenancy.H_TENANT)
    if isinstance(tenant, bytes):
        tenant = tenant.decode(errors="replace")
    try:
        obj = body = decode_obj(message.body)
        if isinstance(obj, dict) and isinstance(obj.get("turn_id"), str):
            turn_id = obj["turn_id"][:128]
    except DecodeError:  # the turn a publisher named in its properties (the client's message_id)
        if message.message_id and re.fullmatch(SAFE_ID_PATTERN, message.message_id):
            turn_id = message.message_id
        body = f"(not msgpack: {len(message.body)} bytes)"
    return DeadLetter(
        id=dead_id(message),
        reason=reason,
        code=code,
        turn_id=turn_id,
        kind=str(headers.get(t.H_KIND, t.KIND_START)),
        size=len(message.body),
        tenant=tenant[:128] if isinstance(tenant, str) else None,
        headers={k: _plain(v) for k, v in headers.items()} if full else None,
        body=_plain(body) if full else None,
    )


def _plain(value: Any) -> Any:
    """``value`` with bytes shown as text and containers walked: what JSON can carry."""
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode(errors="replace")
    if isinstance(value, dict):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def _of(message: AbstractIncomingMessage, tenant: str | None) -> bool:
    """Whether ``message`` is one the command sees: any without a tenant, else the tenant's."""
    return tenant is None or describe(message).tenant == tenant


async def _take_all(channel: AbstractChannel) -> list[AbstractIncomingMessage]:
    queue = await channel.get_queue(t.DEAD_LETTER_QUEUE, ensure=False)
    taken: list[AbstractIncomingMessage] = []
    while True:
        message = await queue.get(no_ack=False, fail=False, timeout=10)
        if message is None:
            return taken
        taken.append(message)


async def list_dead(
    amqp_url: str, tls: TlsFiles | None = None, tenant: str | None = None, *, full: bool = False
) -> list[DeadLetter]:
    """The letters the caller sees (all, or the tenant's); with ``full``, headers and body."""
    connection = await connect(amqp_url, name="loopwire-cli", tls=tls)
    async with connection:
        channel = await connection.channel()
        taken = await _take_all(channel)
        described = [describe(m, full=full) for m in taken if _of(m, tenant)]
        for message in taken:
            await message.nack(requeue=True)
        return described


async def purge(
    amqp_url: str, wanted: str | None, tls: TlsFiles | None = None, tenant: str | None = None
) -> list[DeadLetter]:
    """Remove the letter ``wanted`` (``None``: every letter the caller sees) for good; the
    letters removed (none: no such id)."""
    connection = await connect(amqp_url, name="loopwire-cli", tls=tls)
    async with connection:
        channel = await connection.channel()
        taken = await _take_all(channel)
        removed: list[DeadLetter] = []
        for message in taken:
            if _of(message, tenant) and wanted in (None, dead_id(message)):
                removed.append(describe(message))
                await message.ack()
            else:
                await message.nack(requeue=True)
        return removed


async def replay(
    amqp_url: str, wanted: str, tls: TlsFiles | None = None, tenant: str | None = None
) -> DeadLetter | None:
    """Republish the dead letter ``wanted`` to the turn queue; ``None`` when there is no such id.

    A dead *step* is refused (``NotReplayableError``) and left where it is: the worker that
    dead-lettered it ended its turn (``finish_reason: error``, a reply to the publisher), so
    the step would find no turn to run and be dropped. To run that work again, publish the
    turn's request anew, with a new turn id. A dead turn request (an unknown agent, say, since
    added to the agents file) is replayed as it was."""
    connection = await connect(amqp_url, name="loopwire-cli", tls=tls)
    me = login(resolve_urls(urls=amqp_url)[0])
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        taken = await _take_all(channel)
        found: DeadLetter | None = None
        refused: DeadLetter | None = None
        for message in taken:
            if found is None and dead_id(message) == wanted and _of(message, tenant):
                found = describe(message)
                if found.kind == t.KIND_STEP:
                    await message.nack(requeue=True)
                    refused = found
                    continue
                headers = {
                    k: v for k, v in (message.headers or {}).items() if k not in _DEAD_HEADERS
                }
                user_id = message.user_id if message.user_id == me else None
                if tenant is not None:  # vouched for as the tenant's, as the client does
                    user_id, headers[tenancy.H_TENANT] = me, tenant
                await channel.default_exchange.publish(
                    aio_pika.Message(
                        message.body,
                        headers=headers,
                        content_type=message.content_type,
                        message_id=message.message_id,
                        correlation_id=message.correlation_id,
                        reply_to=message.reply_to,
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                        user_id=user_id,
                    ),
                    routing_key=t.TURNS_QUEUE,
                )
                await message.ack()
            else:
                await message.nack(requeue=True)
        if refused is not None:
            raise NotReplayableError(
                f"not replayed: {refused.id} is step work of turn {refused.turn_id or '-'} ({refused.code}): "
                "the worker ended that turn with finish_reason error when it dead-lettered it, "
                "so a replay would run nothing. To run the work again, publish the turn's "
                "request anew with a new turn id. The letter stays in the dead-letter queue."
            )
        return found
