"""The client's hold on a published turn (``contracts.handle.TurnHandle``), over a stand-in for
the broker: what it makes of the events that reach its queue."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from contracts.codec import encode
from contracts.events import TurnRejected, make_event
from contracts.handle import TurnHandle, TurnRejectedError
from contracts.turns import InputMessage, TurnRejection, TurnRequest


@dataclass
class Delivered:
    """What the handle reads of a message on its queue."""

    body: bytes
    type: str | None = None


def rejected(session_id: str, code: str = "turn_id_in_use") -> Delivered:
    event = make_event(
        "turn.rejected",
        TurnRejected(reason="refused", code=code),
        agent="support",
        time=1.0,
        turn_id="turn-1",
        session_id=session_id,
    )
    return Delivered(encode(event), type="turn.rejected")  # as events go: type = the event type


async def handle_of(session_id: str) -> TurnHandle:
    request = TurnRequest(
        turn_id="turn-1",
        session_id=session_id,
        agent="support",
        input=(InputMessage(content="hi"),),
    )
    channel = SimpleNamespace(default_exchange=None)
    return TurnHandle(request, None, cast(AbstractChannel, channel))


async def deliver(handle: TurnHandle, message: Delivered) -> None:
    await handle.take(cast(AbstractIncomingMessage, cast(Any, message)))


async def test_another_sessions_refused_request_for_the_same_turn_id_is_not_this_turns_end() -> (
    None
):
    handle = await handle_of("s-a")

    await deliver(handle, rejected("s-b"))

    assert not handle.done
    with pytest.raises(asyncio.TimeoutError):
        await handle.accepted(0.01)


async def test_its_own_rejection_ends_the_turn() -> None:
    handle = await handle_of("s-a")

    await deliver(handle, rejected("s-a", "unknown_agent"))

    with pytest.raises(TurnRejectedError):
        await handle.result(1)


async def test_the_workers_answer_to_a_refused_request_ends_the_turn() -> None:
    """The rejection the worker sends to the request's reply queue (``type: turn.rejected``)
    ends the turn on its own: the event may be left out of ``LOOPWIRE_EVENTS``."""
    handle = await handle_of("s-a")
    rejection = TurnRejection(
        turn_id="turn-1",
        code="unknown_agent",
        reason="agent 'x' is not configured",
        rejected_at=1.0,
    )

    await deliver(handle, Delivered(encode(rejection), type="turn.rejection"))

    with pytest.raises(TurnRejectedError, match="is not configured"):
        await handle.result(1)
    with pytest.raises(TurnRejectedError):
        await handle.accepted(1)


async def test_its_rejection_event_ends_its_events_as_well() -> None:
    handle = await handle_of("s-a")

    await deliver(handle, rejected("s-a", "unknown_agent"))

    assert [event.type async for event in handle.events()] == ["turn.rejected"]


async def test_another_sessions_refused_request_on_the_shared_reply_queue_is_not_this_turns() -> (
    None
):
    """The client's one reply queue (``contracts.replies``) hands a reply to every handle of
    its turn id: the refusal of another session's request for the same turn id (``in use``)
    is not this turn's end."""
    handle = await handle_of("s-a")
    theirs = TurnRejection(
        turn_id="turn-1",
        session_id="s-b",
        code="turn_id_in_use",
        reason="turn id turn-1 is in use",
        rejected_at=1.0,
    )

    await deliver(handle, Delivered(encode(theirs), type="turn.rejection"))

    assert not handle.done
