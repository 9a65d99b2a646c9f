"""A client for publishers: start a turn, follow its events, await its result.

The client binds its own exclusive queue to ``loopwire.events`` for the turn's
routing keys *before* it publishes the request, so no early event is missed,
and uses the same queue as the request's ``reply_to``. It chooses the turn id,
so publishing the same request again (after a lost confirm, say) is idempotent:
the worker runs it once and answers the duplicate with the stored result.

The connection is robust (reconnects every ``reconnect_s``, 1 s by default, as
workers and tool services do) and takes several addresses, one per node of a RabbitMQ
cluster: a lost connection is made again to the next node (``contracts.runtime.amqp``). A reply sent while the client was disconnected is
lost with its queue, so after a reconnect the client publishes every waiting
turn's request again: the copy runs nothing, and its answer is the result.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)

from contracts import topology as t
from contracts.base import Contract
from contracts.codec import DecodeError, decode, encode
from contracts.control import TurnCancel, TurnDecision, Verdict
from contracts.events import Event
from contracts.publishing import publishing_exchange
from contracts.runtime.amqp import DEFAULT_URL, connect, resolve_urls
from contracts.runtime.tls import TlsFiles
from contracts.runtime.tracing import inject
from contracts.session_client import Sessions
from contracts.streaming import StreamText, follow_text
from contracts.turns import InputMessage, LimitOverrides, TurnRequest, TurnResult

log = logging.getLogger("loopwire.client")

FINAL_EVENTS = frozenset({"turn.completed", "turn.failed", "turn.cancelled", "turn.rejected"})


class TurnRejectedError(RuntimeError):
    """The worker dead-lettered the request; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def new_id() -> str:
    return uuid.uuid4().hex


def _queue_name() -> str:
    # named, not server-named: a robust connection can re-declare it after a reconnect
    return f"loopwire-client.{uuid.uuid4().hex}"


class TurnHandle:
    """A published turn: iterate its events, await its result."""

    def __init__(
        self,
        request: TurnRequest,
        queue: AbstractQueue,
        channel: AbstractChannel,
        sessions: Sessions | None = None,
        requests: AbstractExchange | None = None,
    ) -> None:
        self.request = request
        self._sessions = sessions
        self._requests = requests or channel.default_exchange
        self.turn_id = request.turn_id
        self._queue = queue
        self._channel = channel
        self._events: asyncio.Queue[Event | TurnResult] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._result: asyncio.Future[TurnResult] = loop.create_future()
        self._accepted: asyncio.Future[None] = loop.create_future()
        for future in (self._result, self._accepted):  # an unread rejection is not an error
            future.add_done_callback(_retrieve)
        self._tag: str | None = None
        self._closed: Callable[[], object] = lambda: None

    @property
    def done(self) -> bool:
        """Whether the result (or a rejection) has arrived."""
        return self._result.done()

    async def _start(self) -> None:
        self._tag = await self._queue.consume(self._on_message, no_ack=True)

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        try:
            if message.type == "turn.result":
                result = decode(message.body, TurnResult)
                if not self._result.done():
                    self._result.set_result(result)
                if not self._accepted.done():
                    self._accepted.set_result(None)
                await self._events.put(result)
                return
            event = decode(message.body, Event)
        except DecodeError:
            return
        await self._events.put(event)
        if not self._accepted.done() and event.type != "turn.rejected":
            self._accepted.set_result(None)
        # The result is the direct reply (the publisher's copy), never the turn.completed /
        # turn.failed event's copy: they differ when the agent redacts (the event keeps the
        # placeholders). A finished turn always replies, also to a repeated step or request.
        data = event.data
        if event.type == "turn.rejected" and not self._result.done():
            error = TurnRejectedError(getattr(data, "reason", "rejected"))
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
        self._closed()
        if self._tag is not None:
            await self._queue.cancel(self._tag)
            self._tag = None
        await self._queue.delete(if_unused=False, if_empty=False)


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


class LoopwireClient:
    """``async with LoopwireClient(url) as client: result = await client.run_turn(...)``."""

    def __init__(
        self,
        amqp_url: str | Sequence[str] = DEFAULT_URL,
        *,
        reconnect_s: float = 1.0,
        tls: TlsFiles | None = None,
    ) -> None:
        """``amqp_url``: one URL, or a list of them (one per node of a RabbitMQ cluster; also
        as one comma-separated string): the client fails over between them. ``tls``: the CA
        file and, optionally, client certificate and key of ``amqps://`` addresses (the
        server's certificate and host name are always verified).

        ``LoopwireClient("amqps://user:pw@rabbit:5671/", tls=TlsFiles(ca_file=Path("ca.pem")))``
        """
        self.amqp_urls = (
            resolve_urls(urls=amqp_url) if isinstance(amqp_url, str) else tuple(amqp_url)
        )
        if not self.amqp_urls:
            raise ValueError("no AMQP address given")
        self.amqp_url = self.amqp_urls[0]
        """The first address (the one tried first)."""
        self.reconnect_s = reconnect_s
        self.tls = tls
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._waiting: dict[str, TurnHandle] = {}
        self._sessions: Sessions | None = None
        self._requests: AbstractExchange | None = None

    @property
    def requests(self) -> AbstractExchange:
        """Where requests are published (``contracts.publishing``)."""
        if self._requests is None:
            raise RuntimeError("LoopwireClient is not connected")
        return self._requests

    @property
    def sessions(self) -> Sessions:
        """Sessions as a resource: ``get``, ``history``, ``turns``, ``result``, ``delete``."""
        if self._sessions is None:
            self._sessions = Sessions(self.channel, exchange=self.requests)
        return self._sessions

    async def __aenter__(self) -> LoopwireClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        self._connection = await connect(
            self.amqp_urls,
            name="loopwire-client",
            reconnect_interval_s=self.reconnect_s,
            tls=self.tls,
        )
        self._connection.reconnect_callbacks.add(self._ask_again)
        self._channel = await self._connection.channel(publisher_confirms=True)
        self._requests = await publishing_exchange(self._connection, self._channel)

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None

    async def _ask_again(self, *_: object) -> None:
        """After a reconnect, publish each waiting turn's request again. A reply or event
        published while the client was away went to its reply queue, which the broker dropped
        with the connection; the copy (same turn id) runs nothing: loopwire answers it with
        the stored result of a finished turn, or remembers its ``reply_to`` beside the first's
        for a running one, so the result still arrives."""
        for handle in list(self._waiting.values()):
            if handle.done:
                continue
            try:
                await self.publish(handle.request)
            except Exception:  # lost again: the next reconnect asks again
                log.warning("could not publish turn %s again after a reconnect", handle.turn_id)

    @property
    def channel(self) -> AbstractChannel:
        if self._channel is None:
            raise RuntimeError("LoopwireClient is not connected")
        return self._channel

    async def start_turn(
        self,
        agent: str,
        input: str | Sequence[str],
        *,
        session_id: str | None = None,
        turn_id: str | None = None,
        persist: bool = True,
        limits: LimitOverrides | None = None,
        metadata: dict[str, Any] | None = None,
        deadline: float | None = None,
        timeout_s: float | None = None,
        stream: bool | None = None,
    ) -> TurnHandle:
        """Publish a turn. ``deadline`` (Unix time) or ``timeout_s`` (from now) bounds it: the
        model and tool calls get at most the time left, and a turn past it ends as
        ``cancelled`` with ``stopped_by: deadline``. ``stream``: stream the answers' text
        (``handle.stream()``), or not, whatever the agent's profile says."""
        if timeout_s is not None:
            deadline = min(deadline or math.inf, time.time() + timeout_s)
        texts = [input] if isinstance(input, str) else list(input)
        turn_id = turn_id or new_id()
        queue = await self.channel.declare_queue(_queue_name(), exclusive=True, auto_delete=True)
        await queue.bind(t.EVENTS_EXCHANGE, routing_key=f"*.*.*.{turn_id}")
        request = TurnRequest(
            turn_id=turn_id,
            session_id=session_id or new_id(),
            agent=agent,
            input=tuple(InputMessage(content=text) for text in texts),
            persist=persist,
            limits=limits or LimitOverrides(),
            metadata=metadata or {},
            reply_to=queue.name,
            deadline=deadline,
            stream=stream,
        )
        handle = TurnHandle(request, queue, self.channel, self.sessions, self.requests)
        await handle._start()
        self._waiting[turn_id] = handle
        handle._closed = lambda: self._waiting.pop(turn_id, None)
        await self.publish(request)
        return handle

    async def publish(self, request: TurnRequest) -> None:
        """Publish a request as is (confirmed by the broker). When the caller runs in an
        OpenTelemetry span, the request carries it (``traceparent``): the turn is its child."""
        headers: dict[str, Any] = {t.H_KIND: t.KIND_START}
        inject(headers)
        await self.requests.publish(
            aio_pika.Message(
                encode(request),
                content_type=t.CONTENT_TYPE,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                message_id=request.turn_id,
                headers=headers,
            ),
            routing_key=t.TURNS_QUEUE,
        )

    async def cancel(
        self,
        turn_id: str,
        reason: str = "cancelled",
        *,
        session_id: str | None = None,
        by: str | None = None,
    ) -> None:
        """Cancel a turn by its id (``turn.cancel``); naming its session saves a lookup."""
        cancel = TurnCancel(
            turn_id=turn_id, session_id=session_id, reason=reason, by=by, at=time.time()
        )
        await publish_control(self.requests, t.KIND_CANCEL, cancel)

    async def decide(
        self,
        turn_id: str,
        call_id: str,
        decision: Verdict,
        *,
        message: str | None = None,
        arguments: dict[str, Any] | None = None,
        by: str | None = None,
        session_id: str | None = None,
    ) -> None:
        """Decide one call a turn waits on (``turn.decision``): ``approve``, ``edit`` (with
        ``arguments``) or ``reject`` (with a ``message`` for the model)."""
        control = TurnDecision(
            turn_id=turn_id,
            session_id=session_id,
            call_id=call_id,
            decision=decision,
            message=message,
            arguments=arguments,
            by=by,
            at=time.time(),
        )
        await publish_control(self.requests, t.KIND_DECISION, control)

    async def run_turn(
        self,
        agent: str,
        input: str | Sequence[str],
        *,
        session_id: str | None = None,
        timeout: float = 300.0,
        **options: Any,
    ) -> TurnResult:
        handle = await self.start_turn(agent, input, session_id=session_id, **options)
        try:
            return await handle.result(timeout)
        finally:
            await handle.close()

    async def tree(self, root_turn_id: str) -> AsyncIterator[Event]:
        """Every event of a turn and of its child turns however deep (their events carry the
        root's turn id), from now on."""
        async for event in self.subscribe("#"):
            if event.turn_id == root_turn_id or event.root_turn_id == root_turn_id:
                yield event

    async def subscribe(self, pattern: str = "#") -> AsyncIterator[Event]:
        """Every event whose routing key matches ``pattern`` (e.g. ``tool.invoked.#``), from now on."""
        queue = await self.channel.declare_queue(_queue_name(), exclusive=True, auto_delete=True)
        await queue.bind(t.EVENTS_EXCHANGE, routing_key=pattern)
        async with queue.iterator(no_ack=True) as messages:
            async for message in messages:
                try:
                    yield decode(message.body, Event)
                except DecodeError:
                    continue
