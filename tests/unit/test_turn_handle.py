"""The client's hold on a published turn (``contracts.handle.TurnHandle``), over a stand-in for
the broker: what it makes of the events that reach its queue."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from contracts.codec import encode
from contracts.events import TurnRejected, make_event
from contracts.handle import TurnHandle, TurnRejectedError
from contracts.turns import InputMessage, TurnRequest


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
    return Delivered(encode(event))


async def handle_of(session_id: str) -> TurnHandle:
    request = TurnRequest(
        turn_id="turn-1",
        session_id=session_id,
        agent="support",
        input=(InputMessage(content="hi"),),
    )
    channel = SimpleNamespace(default_exchange=None)
    return TurnHandle(request, cast(AbstractQueue, None), cast(AbstractChannel, channel))


async def deliver(handle: TurnHandle, message: Delivered) -> None:
    await handle._on_message(cast(AbstractIncomingMessage, cast(Any, message)))


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
