"""Deleting a session (``session.delete`` on ``loopwire.turns``), the sequencer's part.

The session's unfinished turns are cancelled first, through the one cancel path: a queued
turn ends at once, the running or parked one at its next step or lease renewal (each with its
``turn.cancelled`` event and its replies). Until none is left the message goes back to the
delay queue (``Busy``) and is judged again: no worker waits. Then, under the session's lease,
renewed while it works (so that no step writes meanwhile), every record of the session is
erased (``worker.session.records``: a turn request arriving meanwhile is told to come back
later, and then starts the session anew), its session-scoped memories are forgotten where a
memory store is configured, ``session.deleted`` is announced, a ``session.delete`` goes out
for each child session its turns started in a session derived from it (not one a profile
names), and ``reply_to`` gets a ``SessionReply``. A session that does not exist is deleted as
well: nothing is left of it either way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from contracts.control import TurnCancel
from contracts.events import UNKNOWN, SessionDeleted, make_event
from contracts.sessions import SessionDelete, SessionReply
from contracts.turns import TurnRequest
from worker.loop import EventSink
from worker.loop.children import child_session_id
from worker.sequencing.actions import Action, Answer, Busy, Control
from worker.session.history_cache import HistoryCache
from worker.session.leases import LeaseKeeper
from worker.session.memories import SessionMemories
from worker.session.port import SessionStore
from worker.session.records import SessionRecords

log = logging.getLogger("loopwire.sequencer")

Forget = Callable[[str], Awaitable[int]]
"""Forget a session's memories (``tool_services.memory``); the number forgotten."""


class Erasure:
    """Mixed into ``SessionSequencer``: what it has that this uses."""

    store: SessionStore
    leases: LeaseKeeper
    events: EventSink
    clock: Callable[[], float]
    records: SessionRecords | None
    forget: Forget | None

    async def on_cancel(self, cancel: TurnCancel) -> list[Action]:
        raise NotImplementedError

    async def on_session_delete(self, order: SessionDelete) -> list[Action]:
        if self.records is None:
            raise RuntimeError("this sequencer has no session records to erase")
        session_id = order.session_id
        unfinished = await self.records.unfinished(session_id)
        if unfinished:
            actions: list[Action] = []
            for turn_id in unfinished:
                actions += await self.on_cancel(
                    TurnCancel(
                        turn_id=turn_id, session_id=session_id, reason=order.reason, by=order.by
                    )
                )
            return [*actions, Busy()]  # judged again once they have ended
        session = await self.store.take(session_id)
        if session is None:
            return [Busy()]
        state = session.take_state()
        self.leases.hold(session, f"erasure of {session_id}")
        try:
            erased = await self.records.erase(session_id, session.token)  # the lease with it
            session.released = erased is not None
        finally:
            self.leases.drop(session)
            if not session.released:
                await self.store.release(session)
        if erased is None:
            return [Busy()]  # the lease was lost, or a turn came first: judged again
        deleted = erased.deleted
        if self.forget is not None:
            await self.forget(session_id)
        event = make_event(
            "session.deleted",
            SessionDeleted(
                session_id=session_id,
                reason=order.reason,
                by=order.by,
                deleted_keys=deleted,
            ),
            agent=state.agent if state is not None else UNKNOWN,
            time=self.clock(),
            session_id=session_id,
        )
        try:
            await self.events.emit(event)
        except Exception:
            log.exception("could not publish session.deleted for %s", session_id)
        log.info("session %s deleted (%d keys)", session_id, deleted)
        children: list[Action] = [
            Control(SessionDelete(session_id=child, reason=order.reason, by=order.by))
            for child in erased.children
        ]
        if order.reply_to is None:
            return children
        reply = SessionReply(ok=True, deleted_keys=deleted)
        return [*children, Answer(order.reply_to, delete_correlation(session_id), reply)]

    async def note_children(self, session_id: str, requests: Sequence[TurnRequest]) -> None:
        """Record the sessions derived from ``session_id`` that ``requests`` start children in
        (a session a profile names is the caller's: not deleted with this one)."""
        derived = [
            r.session_id
            for r in requests
            if r.parent is not None
            and r.session_id
            == child_session_id(r.parent.session_id, r.parent.turn_id, r.parent.call_id)
        ]
        await self.store.note_children(session_id, derived)


def delete_correlation(session_id: str) -> str:
    """The correlation id of the reply to a session's deletion."""
    return f"delete:{session_id}"


def forgetting(cache: HistoryCache | None, memories: SessionMemories | None) -> Forget:
    """What a worker forgets of an erased session besides Redis: its copy of the history, and
    the long-term memories (their count)."""

    async def forget(session_id: str) -> int:
        if cache is not None:
            cache.drop(session_id)
        return await memories.forget(session_id) if memories is not None else 0

    return forget
