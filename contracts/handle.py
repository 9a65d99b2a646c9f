"""A published turn, as the client holds it: its events, its result, its controls (cancel,
decide) and its streamed text. ``LoopwireClient.start_turn`` makes one."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractIncomingMessage

from contracts import topology as t
from contracts.base import Contract
from contracts.codec import DecodeError, decode, encode
from contracts.control import TurnCancel, TurnDecision, Verdict
from contracts.events import Event
from contracts.replies import ReplyQueue
from contracts.session_client import Sessions
from contracts.streaming import StreamText, follow_text
from contracts.turns import TurnRejection, TurnRequest, TurnResult

log = logging.getLogger("loopwire.client")

FINAL_EVENTS = frozenset({"turn.completed", "turn.failed", "turn.cancelled", "turn.rejected"})


class TurnRejectedError(RuntimeError):
    """The worker dead-lettered the request; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TurnHandle:
    """A published turn: iterate its events, await its result."""

    def __init__(
        self,
        request: TurnRequest,
        replies: ReplyQueue | None,
        channel: AbstractChannel,
        sessions: Sessions | None = None,
        requests: AbstractExchange | None = None,
    ) -> None:
        self.request = request
        self._sessions = sessions
        self._requests = requests or channel.default_exchange
        self.turn_id = request.turn_id
        self._replies = replies
        self._channel = channel
        self._events: asyncio.Queue[Event | TurnResult] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._result: asyncio.Future[TurnResult] = loop.create_future()
        self._accepted: asyncio.Future[None] = loop.create_future()
        for future in (self._result, self._accepted):  # an unread rejection is not an error
            future.add_done_callback(_retrieve)
        self._closed: Callable[[], object] = lambda: None

    @property
    def done(self) -> bool:
        """Whether the result (or a rejection) has arrived."""
        return self._result.done()

    async def take(self, message: AbstractIncomingMessage) -> None:
        """A message of this turn from the client's reply queue (``contracts.replies``): its
        result, a rejection of its request, or one of its events."""
        try:
            if message.type == "turn.result":
                result = decode(message.body, TurnResult)
                if result.session_id != self.request.session_id:
                    return  # another session's turn id (its request was refused: not ours)
                if not self._result.done():
                    self._result.set_result(result)
                if not self._accepted.done():
                    self._accepted.set_result(None)
                await self._events.put(result)
                return
            if message.type == "turn.rejection":  # the worker's answer to a refused request
                rejection = decode(message.body, TurnRejection)
                if rejection.session_id in (None, self.request.session_id):
                    self._reject(rejection.reason)
                return
            event = decode(message.body, Event)
        except DecodeError:
            return
        if event.session_id is not None and event.session_id != self.request.session_id:
            return  # another session's request that named this turn id (refused: not ours)
        await self._events.put(event)
        if not self._accepted.done() and event.type != "turn.rejected":
            self._accepted.set_result(None)
        # The result is the direct reply (the publisher's copy), never the turn.completed /
        # turn.failed event's copy: they differ when the agent redacts (the event keeps the
        # placeholders). A finished turn always replies, also to a repeated step or request.
        if event.type == "turn.rejected":
            self._reject(getattr(event.data, "reason", "rejected"))

    def _reject(self, reason: str) -> None:
        if self._result.done():
            return
        error = TurnRejectedError(reason)
        self._result.set_exception(error)
        if not self._accepted.done():
            self._accepted.set_exception(error)

    async def events(self) -> AsyncIterator[Event]:
        """The turn's events in order, ending with turn.completed / turn.failed / turn.rejected."""
        while True:
            item = await self._events.get()
            if isinstance(item, TurnResult):
                continue  # the direct reply; the final event still follows
            yield item
            if item.type in FINAL_EVENTS:
                return

    async def stream(self) -> AsyncIterator[StreamText | TurnResult]:
        """The text of the turn's answers as it arrives (``StreamText``: step, text,
        ``restarted``), ending with the ``TurnResult``; a step whose deltas were missed is
        filled in from its saved text (``contracts.streaming``). The turn streams when its
        request or its agent's profile asks (``start_turn(..., stream=True)``). Reads the same
        stream as ``events()``: use one of the two."""
        sessions = self._sessions or Sessions(self._channel, exchange=self._requests)

        async def read_text(step: int) -> str | None:
            return await sessions.text(self.request.session_id, self.turn_id, step)

        async for piece in follow_text(self.events(), read_text):
            yield piece
        yield await self.result(None)

    async def accepted(self, timeout: float | None = 300.0) -> None:
        """Wait until a worker accepted the turn into its session's queue (``turn.accepted``).

        Turns of one session run in the order they are accepted; a publisher that
        needs its own successive turns in order waits for this before the next."""
        await asyncio.wait_for(asyncio.shield(self._accepted), timeout)

    async def result(self, timeout: float | None = 300.0) -> TurnResult:
        return await asyncio.wait_for(asyncio.shield(self._result), timeout)

    async def cancel(self, reason: str = "cancelled", *, by: str | None = None) -> None:
        """Cancel this turn wherever it is; its result then arrives with ``finish_reason:
        cancelled`` (or the turn's own, if it finished first)."""
        cancel = TurnCancel(
            turn_id=self.turn_id,
            session_id=self.request.session_id,
            reason=reason,
            by=by,
            at=time.time(),
        )
        await publish_control(self._requests, t.KIND_CANCEL, cancel)

    async def approvals(self) -> AsyncIterator[Event]:
        """The turn's ``approval.requested`` events as they come (``event.data``: call id,
        tool, arguments, until), until the turn ends. Reads the same stream as ``events()``:
        use one of the two."""
        async for event in self.events():
            if event.type == "approval.requested":
                yield event

    async def decide(
        self,
        call_id: str,
        decision: Verdict,
        *,
        message: str | None = None,
        arguments: dict[str, Any] | None = None,
        by: str | None = None,
    ) -> None:
        """Decide one call this turn waits on (``turn.decision``)."""
        await publish_control(
            self._requests,
            t.KIND_DECISION,
            TurnDecision(
                turn_id=self.turn_id,
                session_id=self.request.session_id,
                call_id=call_id,
                decision=decision,
                message=message,
                arguments=arguments,
                by=by,
                at=time.time(),
            ),
        )

    async def close(self) -> None:
        """Follow the turn no more (the turn itself goes on)."""
        self._closed()
        if self._replies is not None:
            self._replies.leave(self)


async def publish_control(exchange: AbstractExchange, kind: str, control: Contract) -> None:
    """Publish a control message (``turn.cancel``, ``turn.decision``), confirmed."""
    await exchange.publish(
        aio_pika.Message(
            encode(control),
            content_type=t.CONTENT_TYPE,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            headers={t.H_KIND: kind},
        ),
        routing_key=t.TURNS_QUEUE,
    )


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
