"""A turn request the worker refused (dead-lettered on its first delivery), made known: a
``TurnRejection`` to the reply queue its publisher named, and ``turn.rejected`` on the events
exchange where its turn id can be read (``worker.transport.consumer`` calls this)."""

from __future__ import annotations

import logging
import time

from aio_pika.abc import AbstractIncomingMessage

from contracts import tenancy
from contracts.events import UNKNOWN, TurnRejected, make_event
from contracts.turns import TurnRejection
from worker.loop import EventSink
from worker.transport.delivery import rejected_request
from worker.transport.outbox import Outbox
from worker.transport.tenants import Tenants

log = logging.getLogger("loopwire.consumer")


async def announce_rejected(
    message: AbstractIncomingMessage,
    reason: str,
    code: str,
    *,
    outbox: Outbox,
    events: EventSink,
    tenants: Tenants,
) -> None:
    """A refused turn request: its publisher gets a ``TurnRejection`` on the reply queue it
    named, and ``turn.rejected`` is announced where its turn id can be read (from the body,
    else the ``message_id`` it was published with)."""
    turn_id, agent, session_id, reply_to = rejected_request(message)
    if reply_to is not None:
        rejection = TurnRejection(
            turn_id=turn_id,
            session_id=session_id,
            agent=agent,
            code=code[:64],
            reason=reason,
            rejected_at=time.time(),
        )
        await outbox.reject(reply_to, rejection, turn_id or message.correlation_id)
    if turn_id is None or (tenants.enabled and tenancy.current() is None):
        return  # no turn, or a message refused before its tenant was known: no one's events
    event = make_event(
        "turn.rejected",
        TurnRejected(reason=reason, code=code[:64]),
        agent=agent or UNKNOWN,
        time=time.time(),
        turn_id=turn_id,
        session_id=session_id,
    )
    try:
        await events.emit(event)
    except Exception:
        log.exception("could not publish turn.rejected")
