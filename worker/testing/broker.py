"""In-memory stand-ins for the consumer's surroundings: a publisher that records what it was
asked to publish, a delivery that records how it was settled, and a model that gives scripted
answers."""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiormq import spec
from aiormq.exceptions import ChannelInvalidStateError

from contracts import topology as t
from contracts.state import ModelResponse
from worker.loop.ports import ModelRequest


@dataclass(frozen=True, slots=True)
class Published:
    """One confirmed publish: where it went, its body and AMQP properties."""

    routing_key: str
    body: bytes
    properties: spec.Basic.Properties
    mandatory: bool
    exchange: str = ""
    """The exchange it was published to (``""``: the default exchange)."""

    @property
    def headers(self) -> dict[str, Any]:
        headers: dict[str, Any] = self.properties.headers or {}
        return headers


class MemoryPublisher:
    """``Publisher`` to ``exchange`` that records every publish (in ``into``, a list that
    another publisher may share, to keep one order); ``fail_with`` makes each publish raise
    instead (e.g. ``ChannelInvalidStateError``: the broker channel is down), recording
    nothing."""

    def __init__(self, exchange: str = "", into: list[Published] | None = None) -> None:
        self.exchange = exchange
        self.published: list[Published] = into if into is not None else []
        self.fail_with: BaseException | None = None

    async def publish(
        self,
        body: bytes,
        *,
        routing_key: str,
        properties: spec.Basic.Properties,
        mandatory: bool = False,
    ) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.published.append(Published(routing_key, body, properties, mandatory, self.exchange))

    def to(self, routing_key: str) -> list[Published]:
        """What was published with ``routing_key``, in order."""
        return [p for p in self.published if p.routing_key == routing_key]


class MemoryDelivery:
    """What the consumer uses of an incoming aio-pika message; counts its acks and nacks. With
    ``channel_closed`` set, ``channel``, ``ack`` and ``nack`` raise as aio-pika's do."""

    def __init__(
        self,
        body: bytes,
        *,
        headers: dict[str, Any] | None = None,
        message_id: str | None = None,
        correlation_id: str | None = None,
        reply_to: str | None = None,
        content_type: str | None = t.CONTENT_TYPE,
        redelivered: bool = False,
        user_id: str | None = None,
        exchange: str = "",
        routing_key: str = t.TURNS_QUEUE,
    ) -> None:
        self.body = body
        self.exchange = exchange
        self.routing_key = routing_key
        """Where it was published: the intake exchange and a tenant's key, or the default."""
        self.user_id = user_id
        """The publisher's AMQP user, as RabbitMQ validated it (``None``: it named none)."""
        self.redelivered = redelivered
        self.headers: dict[str, Any] = dict(headers or {})
        self.message_id = message_id
        self.correlation_id = correlation_id
        self.reply_to = reply_to
        self.content_type = content_type
        self.channel_closed = False
        self.acks = 0
        self.nacks: list[bool] = []
        """The ``requeue`` flag of each nack, in order."""

    @classmethod
    def of(cls, published: Published, headers: Mapping[str, Any] | None = None) -> MemoryDelivery:
        """The delivery of a recorded publish, with ``headers`` added (``x-delivery-count``)."""
        p = published.properties
        return cls(
            published.body,
            headers={**published.headers, **(headers or {})},
            message_id=p.message_id,
            correlation_id=p.correlation_id,
            reply_to=p.reply_to,
            content_type=p.content_type,
            user_id=p.user_id,
            exchange=published.exchange,
            routing_key=published.routing_key,
        )

    @property
    def channel(self) -> object:
        if self.channel_closed:
            raise ChannelInvalidStateError("the delivery channel is closed")
        return self

    @property
    def settlements(self) -> int:
        """How many times the delivery was acked or nacked (exactly one is right)."""
        return self.acks + len(self.nacks)

    async def ack(self, multiple: bool = False) -> None:
        self.channel  # noqa: B018 - raises when the delivery channel is closed
        self.acks += 1

    async def nack(self, multiple: bool = False, requeue: bool = True) -> None:
        self.channel  # noqa: B018 - raises when the delivery channel is closed
        self.nacks.append(requeue)


class ScriptedAnswers:
    """``Model`` answering each call with the next scripted response (or raising the next scripted
    exception); ``assert_done`` fails on a call past the script or an answer never asked for."""

    def __init__(self, answers: Iterable[ModelResponse | BaseException] = ()) -> None:
        self.answers = list(answers)
        self.requests: list[ModelRequest] = []
        """Every request the model got, in order."""
        self.unexpected = 0

    def complete(self, request: ModelRequest) -> Awaitable[ModelResponse]:
        self.requests.append(request)
        if not self.answers:
            self.unexpected += 1
            return self._answer(AssertionError(f"unexpected model call #{len(self.requests)}"))
        return self._answer(self.answers.pop(0))

    def assert_done(self) -> None:
        assert not self.unexpected, f"{self.unexpected} model call(s) past the script"
        assert not self.answers, f"{len(self.answers)} scripted answer(s) never asked for"

    @staticmethod
    async def _answer(answer: ModelResponse | BaseException) -> ModelResponse:
        if isinstance(answer, BaseException):
            raise answer
        return answer
