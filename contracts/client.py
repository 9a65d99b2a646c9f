"""A client for publishers: start a turn, follow its events, await its result.

The client binds its own exclusive queue to ``loopwire.events`` for the turn's
routing keys *before* it publishes the request, so no early event is missed,
and uses the same queue as the request's ``reply_to``: one queue for all the
turns it follows (``contracts.replies``). It chooses the turn id,
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
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import aio_pika
from aio_pika.abc import (
    AbstractExchange,
    AbstractRobustChannel,
    AbstractRobustConnection,
)

from contracts import tenancy
from contracts import topology as t
from contracts.codec import DecodeError, decode, encode
from contracts.control import TurnCancel, TurnDecision, Verdict
from contracts.events import Event
from contracts.handle import FINAL_EVENTS, TurnHandle, TurnRejectedError, publish_control
from contracts.publishing import IntakeProbe, Vouched, intake_exchange, publishing_exchange
from contracts.replies import ReplyQueue, queue_name
from contracts.runtime.amqp import DEFAULT_URL, connect, login, resolve_urls
from contracts.runtime.tls import TlsFiles
from contracts.runtime.tracing import inject
from contracts.session_client import Sessions
from contracts.turns import InputMessage, LimitOverrides, TurnRequest, TurnResult

__all__ = [
    "FINAL_EVENTS",
    "LoopwireClient",
    "TurnHandle",
    "TurnRejectedError",
    "new_id",
    "publish_control",
]

log = logging.getLogger("loopwire.client")


def new_id() -> str:
    return uuid.uuid4().hex


class LoopwireClient:
    """``async with LoopwireClient(url) as client: result = await client.run_turn(...)``."""

    def __init__(
        self,
        amqp_url: str | Sequence[str] = DEFAULT_URL,
        *,
        reconnect_s: float = 1.0,
        tls: TlsFiles | None = None,
        tenant: str | None = None,
    ) -> None:
        """``amqp_url``: one URL, or a list of them (one per node of a RabbitMQ cluster; also
        as one comma-separated string): the client fails over between them. ``tls``: the CA
        file and, optionally, client certificate and key of ``amqps://`` addresses (the
        server's certificate and host name are always verified).

        ``LoopwireClient("amqps://user:pw@rabbit:5671/", tls=TlsFiles(ca_file=Path("ca.pem")))``

        ``tenant``: the client's tenant, for a fleet with tenancy on (docs/tenants.md): its
        messages carry its user (``user_id``) and this tenant, and it follows events within
        it (routing keys ``<tenant>.…``). A trusted user (the HTTP gateway) names the tenant
        it acts for here.
        """
        if tenant is not None and not tenancy.valid(tenant):
            raise ValueError(f"not a tenant name: {tenant[:64]!r}")
        self.tenant = tenant
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
        self._channel: AbstractRobustChannel | None = None
        self._waiting: set[TurnHandle] = set()
        self._replies: ReplyQueue | None = None
        self._opening = asyncio.Lock()
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
        if self.tenant is not None:
            intake = await intake_exchange(self._connection, self._channel)
            probe = IntakeProbe(self._connection, self.tenant)
            vouched = Vouched(self._requests, login(self.amqp_url), self.tenant, intake, probe)
            self._requests = cast(AbstractExchange, vouched)

    async def close(self) -> None:
        if self._connection is not None:
            if self._replies is not None:
                self._replies.shut()
                self._replies = None
            await self._connection.close()
            self._connection = None

    @contextlib.asynccontextmanager
    async def watching(self, turn_id: str) -> AsyncIterator[AsyncIterator[Event]]:
        """A turn's events from now on (bound before this yields), whoever started it: on the
        client's reply queue, as its own turns' are."""
        replies = await self.reply_queue()
        async with replies.watch(turn_id, self._within(f"*.*.*.{turn_id}")) as events:
            yield events

    async def reply_queue(self) -> ReplyQueue:
        """The client's reply queue, opened with its first turn."""
        if self._replies is None:
            async with self._opening:
                if self._replies is None:
                    self._replies = await ReplyQueue.open(self.channel)
        return self._replies

    async def _ask_again(self, *_: object) -> None:
        """After a reconnect, publish each waiting turn's request again. A reply or event
        published while the client was away went to its reply queue, which the broker dropped
        with the connection; the copy (same turn id) runs nothing: loopwire answers it with
        the stored result of a finished turn, or remembers its ``reply_to`` beside the first's
        for a running one, so the result still arrives."""
        for handle in list(self._waiting):
            if handle.done:
                continue
            try:
                await self.publish(handle.request)
            except Exception:  # lost again: the next reconnect asks again
                log.warning("could not publish turn %s again after a reconnect", handle.turn_id)

    @property
    def channel(self) -> AbstractRobustChannel:
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
        replies = await self.reply_queue()
        request = TurnRequest(
            turn_id=turn_id,
            session_id=session_id or new_id(),
            agent=agent,
            input=tuple(InputMessage(content=text) for text in texts),
            persist=persist,
            limits=limits or LimitOverrides(),
            metadata=metadata or {},
            reply_to=replies.name,
            deadline=deadline,
            stream=stream,
        )
        handle = TurnHandle(request, replies, self.channel, self.sessions, self.requests)
        await replies.follow(handle, self._within(f"*.*.*.{turn_id}"))
        self._waiting.add(handle)
        handle._closed = lambda: self._waiting.discard(handle)
        try:
            await self.publish(request)
        except BaseException:
            with contextlib.suppress(Exception):
                await handle.close()
            raise
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
        rollback: bool = False,
    ) -> None:
        """Cancel a turn by its id (``turn.cancel``); naming its session saves a lookup.
        ``rollback``: its messages are removed from the session's history as it ends."""
        cancel = TurnCancel(
            turn_id=turn_id,
            session_id=session_id,
            reason=reason,
            by=by,
            at=time.time(),
            rollback=rollback,
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

    def _within(self, pattern: str) -> str:
        """An event binding within the client's tenant (as published, ``contracts.tenancy``)."""
        return pattern if self.tenant is None else f"{self.tenant}.{pattern}"

    async def subscribe(self, pattern: str = "#") -> AsyncIterator[Event]:
        """Every event whose routing key matches ``pattern`` (e.g. ``tool.invoked.#``), from now on."""
        queue = await self.channel.declare_queue(queue_name(), exclusive=True, auto_delete=True)
        await queue.bind(t.EVENTS_EXCHANGE, routing_key=self._within(pattern))
        async with queue.iterator(no_ack=True) as messages:
            async for message in messages:
                try:
                    yield decode(message.body, Event)
                except DecodeError:
                    continue
