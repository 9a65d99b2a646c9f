"""What a delivery on ``loopwire.turns`` says about itself, read safely: its count headers,
whether it was taken before, its channel, and what a rejected message lets be read (its ids
and reply queue, a child's request, a step)."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from aio_pika.abc import AbstractIncomingMessage
from aiormq.exceptions import ChannelInvalidStateError

from contracts import topology as t
from contracts.base import SAFE_ID_PATTERN
from contracts.codec import DecodeError, decode, decode_obj
from contracts.turns import TurnRequest
from contracts.work import StepWork

_SAFE_ID = re.compile(SAFE_ID_PATTERN)
_REPLY_QUEUE = re.compile(r"[A-Za-z0-9_.:-]{1,255}")
"""The queue names a ``TurnRequest``'s ``reply_to`` may be."""


def channel_closed(message: AbstractIncomingMessage) -> bool:
    """Whether the channel the message was delivered on is closed (nothing to settle it on)."""
    try:
        message.channel  # noqa: B018 - raises when the delivery channel is closed
    except ChannelInvalidStateError:
        return True
    return False


def count(headers: dict[str, Any], name: str, *, bad: int | None = None) -> int:
    """A count header (``x-delivery-count``, the attempt); one that is not a count is bad
    input (``DecodeError``), or ``bad`` where given."""
    value = headers.get(name, 0)
    if type(value) is int and value >= 0:
        return value
    if bad is not None:
        return bad
    raise DecodeError(f"header {name} is not a count: {str(value)[:64]!r}", code="bad_header")


def taken_before(message: AbstractIncomingMessage, headers: dict[str, Any]) -> bool:
    """Whether the message was taken before: redelivered by the broker, or sent again through
    the delay queue after it was taken (``x-loopwire-redone``, a failed attempt)."""
    return bool(
        message.redelivered
        or count(headers, "x-delivery-count", bad=0)
        or count(headers, t.H_ATTEMPT, bad=0)
        or headers.get(t.H_REDONE) is True
    )


def step_work(body: bytes) -> StepWork | None:
    try:
        return decode(body, StepWork)
    except DecodeError:
        return None


def child_request(body: bytes) -> TurnRequest | None:
    """The child turn's request in a rejected message, where it is one."""
    try:
        request = decode(body, TurnRequest)
    except DecodeError:
        return None
    return request if request.parent is not None else None


class Rejected(NamedTuple):
    """What a rejected turn request lets be read safely: its ids and where its publisher waits."""

    turn_id: str | None
    agent: str | None
    session_id: str | None
    reply_to: str | None


def rejected_request(message: AbstractIncomingMessage) -> Rejected:
    """The ids and reply queue of a rejected turn request: from its body where they can be read,
    else from its properties (``message_id``, the turn id the protocol asks publishers to put
    there; ``reply_to``). A reply queue is one a ``TurnRequest`` may name (never one of
    loopwire's own)."""
    try:
        obj = decode_obj(message.body)
    except DecodeError:
        obj = None
    fields: dict[Any, Any] = obj if isinstance(obj, dict) else {}

    def pick(key: str) -> str | None:
        value = fields.get(key)
        return value if isinstance(value, str) and _SAFE_ID.fullmatch(value) else None

    def queue(value: object) -> str | None:
        if isinstance(value, str) and _REPLY_QUEUE.fullmatch(value):
            return None if value.startswith("loopwire.") else value
        return None

    turn_id = pick("turn_id")
    if turn_id is None and message.message_id and _SAFE_ID.fullmatch(message.message_id):
        turn_id = message.message_id
    reply_to = queue(fields.get("reply_to")) or queue(message.reply_to)
    return Rejected(turn_id, pick("agent"), pick("session_id"), reply_to)
