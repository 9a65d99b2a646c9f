"""What the sequencer announces of a turn itself (``turn.accepted``, and a turn's end again):
mixed into ``SessionSequencer`` (``worker.sequencing.sequencer``). An event that cannot be
published is logged, never raised: events only observe."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from contracts.events import TurnAccepted, TurnFinished, finish_event_type, make_event
from contracts.turns import TurnRequest, TurnResult
from worker.loop import EventSink
from worker.runtime.tracing import Tracing
from worker.sequencing.actions import Action, Reply

log = logging.getLogger("loopwire.sequencer")


async def answers(
    deliver: Callable[[TurnResult], Awaitable[TurnResult]],
    result: TurnResult,
    replies: Sequence[str],
) -> list[Action]:
    """A turn's result to each reply queue its publishers named, as delivered to them
    (``deliver``: the publisher's copy, e.g. with redacted values restored)."""
    if not replies:
        return []
    delivered = await deliver(result)
    return [Reply(reply_to, delivered) for reply_to in replies]


class Announcing:
    """Mixed into ``SessionSequencer``: what it has that these use."""

    events: EventSink
    clock: Callable[[], float]
    tracing: Tracing | None

    async def _emit_finished(self, result: TurnResult) -> None:
        event = make_event(
            finish_event_type(result.finish_reason),
            TurnFinished(result=result),
            agent=result.agent,
            time=result.completed_at,
            turn_id=result.turn_id,
            session_id=result.session_id,
            parent=result.parent,
        )
        try:
            await self.events.emit(event)
        except Exception:
            log.exception("could not publish the end of turn %s", result.turn_id)

    async def _emit_accepted(self, request: TurnRequest, at: float | None) -> None:
        """``turn.accepted`` with the time the turn was first accepted (a copy's is the same
        event), in the publisher's trace."""
        if self.tracing is not None:
            with self.tracing.within(request):
                return await self._emit_accepted_now(request, at)
        await self._emit_accepted_now(request, at)

    async def _emit_accepted_now(self, request: TurnRequest, at: float | None) -> None:
        event = make_event(
            "turn.accepted",
            TurnAccepted(persist=request.persist, input_messages=len(request.input)),
            agent=request.agent,
            time=self.clock() if at is None else at,
            turn_id=request.turn_id,
            session_id=request.session_id,
            parent=request.parent,
        )
        try:
            await self.events.emit(event)
        except Exception:
            log.exception("could not publish turn.accepted for %s", request.turn_id)
