"""The consumer's decision table, row by row, over in-memory doubles (no RabbitMQ, no Redis).

Each test hands the consumer a delivery and asserts what a user would see: what was published
where (the next step on ``loopwire.turns``, the result on the publisher's reply queue, a retry
on ``loopwire.turns.retry``, a dead letter with its reason), the events, and how the delivery
was settled — acked exactly once, or given back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, cast

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage
from aiormq.base import FutureStore
from aiormq.exceptions import ChannelInvalidStateError
from prometheus_client import CollectorRegistry
from redis.exceptions import ConnectionError as RedisConnectionError

from contracts import topology as t
from contracts.codec import MAX_MESSAGE_BYTES, decode, encode, encode_obj
from contracts.control import TurnChildResult
from contracts.events import Event, TurnRejected
from contracts.messages import ChatMessage, ToolCall
from contracts.state import ModelResponse
from contracts.tools import ToolCallReply, ToolCallRequest, ToolContext, ToolDefinition
from contracts.turns import InputMessage, TurnParent, TurnRejection, TurnRequest, TurnResult
from contracts.work import StepWork
from worker.errors import RetryableError
from worker.loop.ports import ModelRequest
from worker.profiles.agents import AgentProfile, AgentProfiles
from worker.runtime import failpoints
from worker.runtime.metrics import WorkerMetrics
from worker.testing.broker import MemoryDelivery, MemoryPublisher, Published, ScriptedAnswers
from worker.testing.memory import (
    FunctionTools,
    ListSink,
    MemorySession,
    MemoryStore,
)
from worker.testing.sequencing import sequencer_over
from worker.transport.consumer import Consumer

SESSION = "s1"
WORKER = "loopwire-worker"
"""The workers' AMQP user (the rig's consumer is a worker logged in as it)."""
REPLIES = "client.replies"
POISON_AFTER = 4
MAX_STEP_ATTEMPTS = 3
BUSY_RETRY_S = 0.01
LOOKUP = ToolDefinition(
    name="lookup",
    description="Look an order up.",
    parameters={"type": "object", "properties": {"q": {"type": "string"}}},
)


# -- doubles and building blocks ------------------------------------------------------------


class FlakyStore(MemoryStore):
    """A memory store whose ``take`` raises ``take_error`` while it is set (Redis away)."""

    def __init__(self) -> None:
        super().__init__()
        self.take_error: BaseException | None = None

    async def take(
        self, session_id: str, turn_id: str = "", *, first: bool = False
    ) -> MemorySession | None:
        if self.take_error is not None:
            raise self.take_error
        return await super().take(session_id, turn_id, first=first)


async def lookup(args: dict[str, Any], ctx: ToolContext) -> Any:
    return {"items": [f"order {args.get('q')}: shipped"]}


@dataclasses.dataclass
class Rig:
    store: MemoryStore
    model: ScriptedAnswers
    tools: FunctionTools
    publisher: MemoryPublisher
    dead_letters: MemoryPublisher
    events: ListSink
    registry: CollectorRegistry
    consumer: Consumer

    async def deliver(self, delivery: MemoryDelivery) -> MemoryDelivery:
        # MemoryDelivery has what the consumer uses of an aio-pika incoming message
        await self.consumer.handle(cast(AbstractIncomingMessage, delivery))
        return delivery

    def steps(self) -> list[StepWork]:
        return [decode(p.body, StepWork) for p in self.publisher.to(t.TURNS_QUEUE)]

    def last_step(self) -> Published:
        return self.publisher.to(t.TURNS_QUEUE)[-1]

    def last_step_delivery(self) -> MemoryDelivery:
        return MemoryDelivery.of(self.last_step())

    def replies(self) -> list[TurnResult]:
        return [decode(p.body, TurnResult) for p in self.publisher.to(REPLIES)]

    def retries(self) -> list[Published]:
        return self.publisher.to(t.RETRY_QUEUE)

    def event_types(self, turn_id: str | None = None) -> list[str]:
        return [e.type for e in self.events.events if turn_id is None or e.turn_id == turn_id]

    def counted(self, metric: str, reason: str) -> float:
        value = self.registry.get_sample_value(f"{metric}_total", {"reason": reason})
        return value or 0.0


MakeRig = Callable[..., Rig]


@pytest.fixture
def make_rig() -> Iterator[MakeRig]:
    """Rigs over a memory store and scripted model answers; each model must have been asked
    exactly as often as it was scripted."""
    rigs: list[Rig] = []

    def make(
        *answers: ModelResponse | BaseException,
        store: MemoryStore | None = None,
        agents: Sequence[str | AgentProfile] = ("support",),
        model: ScriptedAnswers | None = None,
        tools: FunctionTools | None = None,
        events: ListSink | None = None,
    ) -> Rig:
        store = store if store is not None else MemoryStore()
        model = model if model is not None else ScriptedAnswers(answers)
        tools = tools if tools is not None else FunctionTools({"lookup": lookup})
        events = events if events is not None else ListSink()
        registry = CollectorRegistry()

        sequencer = sequencer_over(
            store, model=model, tools=tools, definitions=[LOOKUP], events=events, agents=agents
        )
        up = asyncio.Event()
        up.set()
        publisher, dead_letters = MemoryPublisher(), MemoryPublisher()
        consumer = Consumer(
            work=sequencer,
            publisher=publisher,
            dead_letters=dead_letters,
            events=events,
            busy_retry_s=BUSY_RETRY_S,
            max_step_attempts=MAX_STEP_ATTEMPTS,
            poison_after=POISON_AFTER,
            metrics=WorkerMetrics(registry),
            broker_up=up,
            user=WORKER,
        )
        rig = Rig(store, model, tools, publisher, dead_letters, events, registry, consumer)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.model.assert_done()


def request(
    turn_id: str = "t1", *, agent: str = "support", reply_to: str | None = REPLIES
) -> TurnRequest:
    return TurnRequest(
        turn_id=turn_id,
        session_id=SESSION,
        agent=agent,
        input=(InputMessage(content="Where is order 42?"),),
        reply_to=reply_to,
    )


def start(req: TurnRequest, headers: dict[str, Any] | None = None) -> MemoryDelivery:
    """A turn request as a publisher sends it (no kind header: a start)."""
    return MemoryDelivery(
        encode(req), headers=headers, message_id=req.turn_id, reply_to=req.reply_to
    )


def step(turn_id: str, index: int, headers: dict[str, Any] | None = None) -> MemoryDelivery:
    work = StepWork(session_id=SESSION, turn_id=turn_id, step=index)
    return MemoryDelivery(
        encode(work),
        headers={t.H_KIND: t.KIND_STEP, **(headers or {})},
        message_id=f"{turn_id}:{index}",
    )


def calls_lookup(q: str = "42", content: str | None = None) -> ModelResponse:
    call = ToolCall(id="call_1", name="lookup", arguments=json.dumps({"q": q}))
    message = ChatMessage(role="assistant", content=content, tool_calls=(call,))
    return ModelResponse(message=message, finish_reason="tool_calls")


def answers(text: str) -> ModelResponse:
    return ModelResponse(message=ChatMessage(role="assistant", content=text))


def acked_once(delivery: MemoryDelivery) -> bool:
    return delivery.acks == 1 and delivery.nacks == []


def assert_step_message(published: Published, turn_id: str, index: int) -> None:
    assert published.routing_key == t.TURNS_QUEUE
    assert published.mandatory is True
    assert decode(published.body, StepWork) == StepWork(
        session_id=SESSION, turn_id=turn_id, step=index
    )
    assert published.headers == {t.H_KIND: t.KIND_STEP}
    assert published.properties.message_id == f"{turn_id}:{index}"
    assert published.properties.delivery_mode == aio_pika.DeliveryMode.PERSISTENT


def rejections(rig: Rig, queue: str = REPLIES) -> list[tuple[str | None, str | None, str]]:
    """The rejections answered to ``queue``: turn id, session id and code of each."""
    found = []
    for published in rig.publisher.to(queue):
        assert published.properties.message_type == "turn.rejection"
        assert published.properties.correlation_id == decode(published.body, TurnRejection).turn_id
        rejection = decode(published.body, TurnRejection)
        found.append((rejection.turn_id, rejection.session_id, rejection.code))
    return found


def only_dead_letter(rig: Rig) -> Published:
    assert len(rig.dead_letters.published) == 1, rig.dead_letters.published
    letter = rig.dead_letters.published[0]
    assert letter.routing_key == t.TURNS_QUEUE
    return letter


# -- starting turns ---------------------------------------------------------------------------


async def test_new_request_publishes_its_first_step(make_rig: MakeRig) -> None:
    rig = make_rig()

    delivery = await rig.deliver(start(request("t1")))

    assert acked_once(delivery)
    assert len(rig.publisher.published) == 1
    assert_step_message(rig.publisher.published[0], "t1", 0)
    assert rig.dead_letters.published == []
    assert rig.event_types() == ["turn.accepted"]
    assert rig.model.requests == []


async def test_request_queued_behind_another_turn_publishes_nothing(make_rig: MakeRig) -> None:
    rig = make_rig()
    await rig.deliver(start(request("t1")))

    delivery = await rig.deliver(start(request("t2"), {t.H_KIND: t.KIND_START}))

    assert acked_once(delivery)
    assert [s.turn_id for s in rig.steps()] == ["t1"]
    assert rig.store.queues[SESSION] == ["t1", "t2"]
    assert rig.event_types("t2") == ["turn.accepted"]


async def test_duplicate_request_of_a_finished_turn_is_answered_again(make_rig: MakeRig) -> None:
    rig = make_rig(answers("Order 42 shipped yesterday."))
    await rig.deliver(start(request("t1")))
    await rig.deliver(MemoryDelivery.of(rig.last_step()))
    [first] = rig.replies()

    delivery = await rig.deliver(start(request("t1")))

    assert acked_once(delivery)
    assert rig.replies() == [first, first]
    assert first.content == "Order 42 shipped yesterday."
    assert [s.step for s in rig.steps()] == [0]  # no step of its own
    assert rig.counted("loopwire_work_dropped", "duplicate_request") == 1
    assert len(rig.model.requests) == 1


async def test_a_turn_id_another_session_accepted_is_refused_and_that_turn_runs_on(
    make_rig: MakeRig,
) -> None:
    rig = make_rig(answers("Order 42 shipped yesterday."))
    await rig.deliver(start(request("t1")))
    theirs = request("t1", reply_to="other.replies").model_copy(update={"session_id": "s2"})

    delivery = await rig.deliver(start(theirs))

    assert acked_once(delivery)
    letter = only_dead_letter(rig)
    assert letter.headers[t.H_REASON_CODE] == "turn_id_in_use"
    assert "another session" in letter.headers[t.H_REASON]
    rejected = [(e.turn_id, e.session_id) for e in rig.events.events if e.type == "turn.rejected"]
    assert rejected == [("t1", "s2")]
    assert "s2" not in rig.store.turns and "s2" not in rig.store.queues
    await rig.deliver(MemoryDelivery.of(rig.last_step()))
    [result] = rig.replies()
    assert (result.session_id, result.content) == (SESSION, "Order 42 shipped yesterday.")
    # the other publisher hears why its request was refused, and gets no result
    assert rejections(rig, "other.replies") == [("t1", "s2", "turn_id_in_use")]


# -- steps ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "retried"),
    [
        ({t.H_ATTEMPT: 2}, {t.H_ATTEMPT: 2, t.H_REDONE: True}),
        ({}, {t.H_ATTEMPT: 0}),  # found busy, never taken: it comes back as fresh as it was
    ],
    ids=["failed-before", "fresh"],
)
async def test_busy_session_is_retried_with_the_same_attempt(
    make_rig: MakeRig, headers: dict[str, Any], retried: dict[str, Any]
) -> None:
    rig = make_rig()
    await rig.deliver(start(request("t1")))
    other = await rig.store.take(SESSION)  # another worker holds the session's lease
    assert other is not None

    delivery = await rig.deliver(MemoryDelivery.of(rig.last_step(), headers))

    assert acked_once(delivery)
    [retry] = rig.retries()
    assert retry.body == delivery.body
    assert retry.mandatory is True
    assert retry.headers == {t.H_KIND: t.KIND_STEP, **retried}
    assert retry.properties.message_id == "t1:0"
    assert retry.properties.expiration == "10"
    assert [s.step for s in rig.steps()] == [0]
    assert rig.counted("loopwire_work_retried", "busy") == 1
    assert rig.store.leases[SESSION][0] == other.token  # the other worker's lease is untouched
    assert rig.model.requests == []


@pytest.mark.parametrize(
    ("turn_id", "index"),
    [("t1", 5), ("t9", 0)],
    ids=["step-ahead-of-its-turn", "turn-never-requested"],
)
async def test_stale_step_message_is_dropped(make_rig: MakeRig, turn_id: str, index: int) -> None:
    rig = make_rig(calls_lookup())
    await rig.deliver(start(request("t1")))
    await rig.deliver(MemoryDelivery.of(rig.last_step()))
    published = len(rig.publisher.published)

    delivery = await rig.deliver(step(turn_id, index))

    assert acked_once(delivery)
    assert len(rig.publisher.published) == published
    assert rig.dead_letters.published == []
    assert rig.counted("loopwire_work_dropped", "stale_step") == 1


async def test_step_where_the_model_calls_a_tool_publishes_the_next_step(
    make_rig: MakeRig,
) -> None:
    rig = make_rig(calls_lookup(q="42"))
    await rig.deliver(start(request("t1")))

    delivery = await rig.deliver(MemoryDelivery.of(rig.last_step()))

    assert acked_once(delivery)
    assert [(c.tool, c.arguments) for c in rig.tools.calls] == [("lookup", {"q": "42"})]
    assert len(rig.publisher.published) == 2
    assert_step_message(rig.publisher.published[1], "t1", 1)
    assert rig.replies() == []
    assert rig.model.requests[0].messages[-1].content == "Where is order 42?"
    assert [d.name for d in rig.model.requests[0].tools] == ["lookup"]
    assert "step.completed" in rig.event_types("t1")


async def test_last_step_replies_and_starts_the_next_queued_turn(make_rig: MakeRig) -> None:
    rig = make_rig(calls_lookup(), answers("Order 42 shipped yesterday."))
    await rig.deliver(start(request("t1")))
    await rig.deliver(start(request("t2")))
    await rig.deliver(MemoryDelivery.of(rig.last_step()))
    published = len(rig.publisher.published)

    delivery = await rig.deliver(MemoryDelivery.of(rig.last_step()))

    assert acked_once(delivery)
    reply, kick = rig.publisher.published[published:]
    assert reply.routing_key == REPLIES
    assert reply.mandatory is False
    assert reply.properties.correlation_id == "t1"
    assert reply.properties.message_type == "turn.result"
    assert reply.properties.delivery_mode == aio_pika.DeliveryMode.NOT_PERSISTENT
    result = decode(reply.body, TurnResult)
    assert (result.turn_id, result.finish_reason, result.steps) == ("t1", "stop", 2)
    assert result.content == "Order 42 shipped yesterday."
    assert_step_message(kick, "t2", 0)
    assert "turn.completed" in rig.event_types("t1")
    # the tool's result reached the model on the second step
    assert "shipped" in str(rig.model.requests[1].messages[-1].content)


# -- dead letters -------------------------------------------------------------------------


async def test_poison_step_is_dead_lettered_and_its_turn_ended(make_rig: MakeRig) -> None:
    rig = make_rig()
    await rig.deliver(start(request("t1")))

    delivery = await rig.deliver(
        MemoryDelivery.of(rig.last_step(), {"x-delivery-count": POISON_AFTER})
    )

    assert acked_once(delivery)
    letter = only_dead_letter(rig)
    assert letter.body == delivery.body
    assert letter.headers[t.H_REASON_CODE] == "poison"
    assert f"delivered {POISON_AFTER + 1} times" in letter.headers[t.H_REASON]
    assert letter.headers[t.H_KIND] == t.KIND_STEP
    assert letter.headers[t.H_DEAD_ID]
    [result] = rig.replies()
    assert result.finish_reason == "error"
    assert result.error is not None and result.error.code == "poison"
    assert rig.store.results[SESSION, "t1"] == result
    assert "turn.failed" in rig.event_types("t1")
    assert "turn.rejected" not in rig.event_types()
    assert rig.retries() == []
    assert rig.model.requests == []  # the step did not run


async def test_one_delivery_short_of_the_poison_limit_still_runs(make_rig: MakeRig) -> None:
    rig = make_rig(answers("Shipped."))
    await rig.deliver(start(request("t1")))

    delivery = await rig.deliver(
        MemoryDelivery.of(rig.last_step(), {"x-delivery-count": POISON_AFTER - 1})
    )

    assert acked_once(delivery)
    assert rig.dead_letters.published == []
    assert [r.finish_reason for r in rig.replies()] == ["stop"]


async def test_poison_request_is_dead_lettered_and_announced(make_rig: MakeRig) -> None:
    rig = make_rig()

    delivery = await rig.deliver(start(request("t1"), {"x-delivery-count": POISON_AFTER + 3}))

    assert acked_once(delivery)
    assert only_dead_letter(rig).headers[t.H_REASON_CODE] == "poison"
    [rejected] = rig.events.events
    assert (rejected.type, rejected.turn_id, rejected.session_id) == ("turn.rejected", "t1", "s1")
    assert rig.store.turns == {}
    assert rejections(rig) == [("t1", "s1", "poison")]
    assert len(rig.publisher.published) == 1  # the rejection alone


@pytest.mark.parametrize(
    "headers",
    [{t.H_ATTEMPT: "x"}, {t.H_ATTEMPT: -1}, {"x-delivery-count": "3"}, {t.H_ATTEMPT: 1.5}],
)
async def test_a_count_header_that_is_not_a_count_is_dead_lettered(
    make_rig: MakeRig, headers: dict[str, Any]
) -> None:
    rig = make_rig()

    delivery = await rig.deliver(start(request("t1"), headers))

    assert acked_once(delivery)
    assert only_dead_letter(rig).headers[t.H_REASON_CODE] == "bad_header"
    assert rejections(rig) == [("t1", "s1", "bad_header")]
    assert len(rig.publisher.published) == 1


@pytest.mark.parametrize(
    ("body", "code", "turn_id"),
    [
        (b"\xc1", "malformed", "m1"),
        (b"", "malformed", "m1"),
        (encode_obj({"turn_id": "t1", "session_id": "s1", "agent": "support"}), "schema", "t1"),
        (encode_obj(["not", "a", "map"]), "schema", "m1"),
        (b"\x00" * (MAX_MESSAGE_BYTES + 1), "oversize", "m1"),
    ],
    ids=["not-msgpack", "empty", "missing-fields", "not-a-map", "oversize"],
)
async def test_malformed_request_is_dead_lettered_announced_and_answered(
    make_rig: MakeRig, body: bytes, code: str, turn_id: str
) -> None:
    """The turn is the body's where it can be read, else the ``message_id`` it was published
    with; the publisher hears of the rejection on its ``reply_to``."""
    rig = make_rig()

    delivery = await rig.deliver(MemoryDelivery(body, message_id="m1", reply_to=REPLIES))

    assert acked_once(delivery)
    letter = only_dead_letter(rig)
    assert letter.body == body
    assert letter.headers[t.H_REASON_CODE] == code
    assert letter.headers[t.H_REASON]
    assert letter.properties.message_id == "m1"
    assert rig.store.turns == {}
    [event] = rig.events.events
    assert (event.type, event.turn_id) == ("turn.rejected", turn_id)
    assert isinstance(event.data, TurnRejected) and event.data.code == code
    [reply] = rig.publisher.published
    assert (reply.routing_key, reply.properties.correlation_id) == (REPLIES, turn_id)
    rejection = decode(reply.body, TurnRejection)
    assert (rejection.turn_id, rejection.code, rejection.reason) == (
        turn_id,
        code,
        letter.headers[t.H_REASON],
    )


@pytest.mark.parametrize("message_id", [None, "not a turn id", "m1\n"])
@pytest.mark.parametrize("reply_to", [None, "loopwire.turns", "with space"])
async def test_a_request_naming_no_readable_turn_or_queue_is_dead_lettered_alone(
    make_rig: MakeRig, message_id: str | None, reply_to: str | None
) -> None:
    rig = make_rig()

    delivery = await rig.deliver(MemoryDelivery(b"\xc1", message_id=message_id, reply_to=reply_to))

    assert acked_once(delivery)
    assert only_dead_letter(rig).headers[t.H_REASON_CODE] == "malformed"
    assert rig.events.events == []
    assert rig.publisher.published == []  # never to one of loopwire's own queues


async def test_the_bodys_reply_to_is_answered_before_the_property(make_rig: MakeRig) -> None:
    rig = make_rig()
    body = encode_obj({"turn_id": "t1", "session_id": "s1", "reply_to": "body.replies"})

    await rig.deliver(MemoryDelivery(body, reply_to="property.replies"))

    assert [p.routing_key for p in rig.publisher.published] == ["body.replies"]
    assert rejections(rig, "body.replies") == [("t1", "s1", "schema")]


async def test_unknown_message_kind_is_dead_lettered_and_rejects_no_turn(
    make_rig: MakeRig,
) -> None:
    rig = make_rig()

    delivery = await rig.deliver(start(request("t1"), {t.H_KIND: "turn.pause"}))

    assert acked_once(delivery)
    letter = only_dead_letter(rig)
    assert letter.headers[t.H_REASON_CODE] == "unknown_kind"
    assert "turn.pause" in letter.headers[t.H_REASON]
    assert rig.event_types() == []
    assert rig.store.turns == {}
    assert rig.publisher.published == []


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("turn.pause", {"turn_id": "t1", "session_id": SESSION, "agent": "support"}),
        (t.KIND_STEP, {"turn_id": "t1", "session_id": SESSION, "step": -1}),
    ],
    ids=["unknown-kind", "bad-step"],
)
async def test_a_message_naming_a_live_turn_that_is_not_its_request_rejects_it_not(
    make_rig: MakeRig, kind: str, body: dict[str, Any]
) -> None:
    """A publisher newer than this worker (``turn.pause``), or a bad step message, names a
    running turn: the message is dead-lettered with its reason, and the turn goes on with no
    ``turn.rejected`` (which its client would take for the turn's end)."""
    rig = make_rig(answers("Order 42 shipped."))
    await rig.deliver(start(request("t1")))
    kick = rig.last_step()

    delivery = await rig.deliver(MemoryDelivery(encode_obj(body), headers={t.H_KIND: kind}))

    assert acked_once(delivery)
    assert only_dead_letter(rig).headers[t.H_REASON_CODE] in ("unknown_kind", "schema")
    assert rig.event_types("t1") == ["turn.accepted"]
    await rig.deliver(MemoryDelivery.of(kick))
    assert [r.content for r in rig.replies()] == ["Order 42 shipped."]
    assert rig.event_types("t1")[-1] == "turn.completed"


async def test_unknown_agent_is_dead_lettered(make_rig: MakeRig) -> None:
    rig = make_rig()

    delivery = await rig.deliver(start(request("t1", agent="billing")))

    assert acked_once(delivery)
    letter = only_dead_letter(rig)
    assert letter.headers[t.H_REASON_CODE] == "unknown_agent"
    assert "billing" in letter.headers[t.H_REASON]
    [event] = rig.events.events
    assert (event.type, event.turn_id, event.agent) == ("turn.rejected", "t1", "billing")
    assert rig.store.turns == {}  # never accepted
    assert rejections(rig) == [("t1", "s1", "unknown_agent")]
    assert len(rig.publisher.published) == 1
    assert rig.counted("loopwire_dead_lettered", "unknown_agent") == 1


async def test_a_rejected_child_request_tells_its_parent(make_rig: MakeRig) -> None:
    rig = make_rig()
    parent = TurnParent(session_id="p1", turn_id="pt1", call_id="call_0", root_turn_id="pt1")
    child = request("c1", agent="billing", reply_to=None).model_copy(update={"parent": parent})

    delivery = start(child)
    delivery.user_id = WORKER  # a worker started it
    await rig.deliver(delivery)

    assert acked_once(delivery)
    assert only_dead_letter(rig).headers[t.H_REASON_CODE] == "unknown_agent"
    [told] = rig.publisher.to(t.TURNS_QUEUE)
    assert told.headers == {t.H_KIND: t.KIND_CHILD_RESULT}
    assert told.properties.user_id == WORKER
    message = decode(told.body, TurnChildResult)
    assert message.parent == parent
    assert (message.result.turn_id, message.result.finish_reason) == ("c1", "error")
    assert message.result.error is not None and message.result.error.code == "unknown_agent"
    assert "billing" in message.result.error.message


# -- transient failures and failing steps ---------------------------------------------------------


async def test_redis_down_retries_the_step_later(make_rig: MakeRig) -> None:
    store = FlakyStore()
    rig = make_rig(store=store)
    await rig.deliver(start(request("t1")))
    store.take_error = RedisConnectionError("Connection refused")

    delivery = await rig.deliver(MemoryDelivery.of(rig.last_step(), {t.H_ATTEMPT: 1}))

    assert acked_once(delivery)
    [retry] = rig.retries()
    assert retry.body == delivery.body
    assert retry.headers[t.H_ATTEMPT] == 1  # a transient failure does not count as an attempt
    assert rig.counted("loopwire_work_retried", "transient") == 1
    assert rig.dead_letters.published == []
    assert rig.replies() == []


async def test_a_step_whose_redis_failed_after_its_save_publishes_its_next_step_when_retried(
    make_rig: MakeRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step was saved, then Redis failed before its next step was published: the retry
    comes back through the delay queue as taken before, and publishes the next step."""
    rig = make_rig(calls_lookup())
    await rig.deliver(start(request("t1")))
    kick = rig.last_step()

    def redis_fails_after_the_save(point: str) -> None:
        if point == "step_saved":
            raise RedisConnectionError("Connection reset by peer")

    monkeypatch.setattr(failpoints, "hit", redis_fails_after_the_save)
    delivery = await rig.deliver(MemoryDelivery.of(kick))
    monkeypatch.undo()

    assert acked_once(delivery)
    [retry] = rig.retries()
    assert retry.headers[t.H_REDONE] is True
    assert [s.step for s in rig.steps()] == [0]
    again = await rig.deliver(MemoryDelivery.of(retry))

    assert acked_once(again)
    assert [s.step for s in rig.steps()] == [0, 1]
    assert len(rig.tools.calls) == 1  # neither the model nor the tool was asked again


async def test_redis_down_while_dead_lettering_a_step_retries_it(make_rig: MakeRig) -> None:
    store = FlakyStore()
    rig = make_rig(store=store)
    await rig.deliver(start(request("t1")))
    store.take_error = RedisConnectionError("Connection refused")

    delivery = await rig.deliver(
        MemoryDelivery.of(rig.last_step(), {"x-delivery-count": POISON_AFTER})
    )

    assert acked_once(delivery)
    assert rig.dead_letters.published == []  # its turn could not be ended: not dead-lettered
    assert rig.replies() == []
    [retry] = rig.retries()
    assert retry.body == delivery.body
    assert retry.headers[t.H_ATTEMPT] == 0
    assert rig.counted("loopwire_work_retried", "transient") == 1

    # Redis is back: the retried message is judged again, dead-lettered and its turn ended
    store.take_error = None
    again = await rig.deliver(MemoryDelivery.of(retry))

    assert acked_once(again)
    assert only_dead_letter(rig).headers[t.H_REASON_CODE] == "poison"
    assert [(r.finish_reason, r.error and r.error.code) for r in rig.replies()] == [
        ("error", "poison")
    ]


async def test_failing_step_is_retried_then_dead_lettered_and_its_turn_ended(
    make_rig: MakeRig,
) -> None:
    failures = [RuntimeError(f"adapter bug #{n}") for n in range(1, MAX_STEP_ATTEMPTS + 1)]
    rig = make_rig(*failures)
    await rig.deliver(start(request("t1")))
    delivery = MemoryDelivery.of(rig.last_step())

    for attempt in range(1, MAX_STEP_ATTEMPTS):
        await rig.deliver(delivery)
        assert acked_once(delivery)
        assert rig.retries()[-1].headers[t.H_ATTEMPT] == attempt
        assert rig.dead_letters.published == []
        assert SESSION not in rig.store.leases  # the failed step let go of the session
        delivery = MemoryDelivery.of(rig.retries()[-1])

    await rig.deliver(delivery)

    assert acked_once(delivery)
    assert len(rig.retries()) == MAX_STEP_ATTEMPTS - 1
    assert rig.counted("loopwire_work_retried", "failed") == MAX_STEP_ATTEMPTS - 1
    letter = only_dead_letter(rig)
    assert letter.headers[t.H_REASON_CODE] == "step_failed"
    assert letter.headers[t.H_REASON] == (
        f"step failed {MAX_STEP_ATTEMPTS} times: RuntimeError: adapter bug #{MAX_STEP_ATTEMPTS}"
    )
    [result] = rig.replies()
    assert result.finish_reason == "error"
    assert result.error is not None and result.error.code == "step_failed"
    assert "turn.failed" in rig.event_types("t1")
    assert rig.store.queues.get(SESSION, []) == []
    assert len(rig.model.requests) == MAX_STEP_ATTEMPTS


# -- the broker going away ------------------------------------------------------------------------


async def test_channel_down_during_publish_gives_the_delivery_back(make_rig: MakeRig) -> None:
    rig = make_rig()
    rig.publisher.fail_with = ChannelInvalidStateError("publish channel closed")

    delivery = await rig.deliver(start(request("t1")))

    assert delivery.acks == 0
    assert delivery.nacks == [True]  # back to the queue
    assert rig.publisher.published == []

    # the broker delivers it again once the channel is back: the turn is kicked again
    rig.publisher.fail_with = None
    again = await rig.deliver(start(request("t1")))

    assert acked_once(again)
    assert [s.step for s in rig.steps()] == [0]


async def test_channel_down_after_a_step_was_saved_redoes_only_the_publish(
    make_rig: MakeRig,
) -> None:
    rig = make_rig(calls_lookup())
    await rig.deliver(start(request("t1")))
    work = rig.last_step()
    rig.publisher.fail_with = ChannelInvalidStateError("publish channel closed")

    delivery = await rig.deliver(MemoryDelivery.of(work))

    assert delivery.acks == 0 and delivery.nacks == [True]
    rig.publisher.fail_with = None
    redelivery = MemoryDelivery.of(work)
    redelivery.redelivered = True  # as the broker marks a message given back to the queue
    again = await rig.deliver(redelivery)

    assert acked_once(again)
    assert [s.step for s in rig.steps()] == [0, 1]
    assert len(rig.tools.calls) == 1  # neither the model nor the tool was asked again


class HeldAnswers(ScriptedAnswers):
    """Scripted answers, each held back until ``released`` is set: a model call in flight."""

    def __init__(self, *answers: ModelResponse) -> None:
        super().__init__(answers)
        self.asked = asyncio.Event()
        self.released = asyncio.Event()

    def complete(self, request: ModelRequest) -> Awaitable[ModelResponse]:
        answer = super().complete(request)
        self.asked.set()
        return self._held(answer)

    async def _held(self, answer: Awaitable[ModelResponse]) -> ModelResponse:
        await self.released.wait()
        return await answer


class Broker:
    """The broker as a step sees it: events and tool calls fail while it is ``down`` (a publish
    on a closed channel; the tool caller's lost call)."""

    def __init__(self) -> None:
        self.down = False

    def check(self) -> None:
        if self.down:
            raise ChannelInvalidStateError("the broker connection is down")


class BrokerSink(ListSink):
    def __init__(self, broker: Broker) -> None:
        super().__init__()
        self.broker = broker

    async def emit(self, event: Event) -> None:
        self.broker.check()
        await super().emit(event)


class BrokerTools(FunctionTools):
    def __init__(self, broker: Broker) -> None:
        super().__init__({"lookup": lookup})
        self.broker = broker

    async def call(self, request: ToolCallRequest, definition: ToolDefinition) -> ToolCallReply:
        if self.broker.down:
            raise RetryableError("could not send the tool call: the broker connection is down")
        return await super().call(request, definition)


async def test_a_model_answer_arriving_while_the_broker_is_down_is_saved_not_asked_again(
    make_rig: MakeRig,
) -> None:
    broker = Broker()
    model = HeldAnswers(calls_lookup(), answers("Order 42 shipped."))
    rig = make_rig(model=model, tools=BrokerTools(broker), events=BrokerSink(broker))
    await rig.deliver(start(request("t1")))
    work = rig.last_step()
    delivery = MemoryDelivery.of(work)
    # the client runs each delivery's callback as a task of the channel's own, and cancels them
    # all when the connection drops
    callbacks = FutureStore(asyncio.get_running_loop())
    callbacks.create_task(rig.consumer.handle(cast(AbstractIncomingMessage, delivery)))
    await asyncio.wait_for(model.asked.wait(), 5)
    steps = set(rig.consumer.in_flight)

    broker.down, delivery.channel_closed = True, True
    rig.publisher.fail_with = ChannelInvalidStateError("the broker connection is down")
    await callbacks.reject_all(ConnectionError("the broker connection is down"))
    model.released.set()  # the answer arrives while the connection is down
    done, _ = await asyncio.wait(steps, timeout=5)
    assert steps and done == steps, "the step did not end"

    assert delivery.settlements == 0  # the broker delivers it again
    broker.down, rig.publisher.fail_with = False, None
    again = await rig.deliver(
        MemoryDelivery(delivery.body, headers=delivery.headers, redelivered=True)
    )
    assert acked_once(again)
    assert len(model.requests) == 1, "the answer that arrived during the drop was asked again"
    assert len(rig.tools.calls) == 1
    final = await rig.deliver(rig.last_step_delivery())

    assert acked_once(final)
    assert len(model.requests) == 2
    assert [r.content for r in rig.replies()] == ["Order 42 shipped."]


async def test_closed_delivery_channel_is_neither_acked_nor_nacked(make_rig: MakeRig) -> None:
    rig = make_rig()
    rig.publisher.fail_with = ChannelInvalidStateError("connection lost")
    delivery = start(request("t1"))
    delivery.channel_closed = True

    await rig.deliver(delivery)

    assert delivery.settlements == 0  # the broker delivers it again
    assert rig.publisher.published == []
    assert rig.dead_letters.published == []


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        (t.KIND_CANCEL, {"turn_id": "t1", "reason": ""}),
        (t.KIND_DECISION, {"turn_id": "t1", "call_id": "c1", "decision": "edit"}),
        (t.KIND_CANCEL, {"turn_id": "t1", "surprise": 1}),
        (t.KIND_CHILD_RESULT, {"parent": {"turn_id": "t1"}, "result": {}}),
        (t.KIND_CHILD_RESULT, {"turn_id": "t1", "result": None}),
    ],
)
async def test_a_malformed_control_message_is_dead_lettered_and_rejects_no_turn(
    make_rig: MakeRig, kind: str, body: dict[str, Any]
) -> None:
    rig = make_rig()
    await rig.deliver(start(request("t1")))

    delivery = await rig.deliver(MemoryDelivery(encode_obj(body), headers={t.H_KIND: kind}))

    assert acked_once(delivery)
    letter = only_dead_letter(rig)
    assert letter.headers[t.H_REASON_CODE] == "schema"
    assert rig.event_types("t1") == ["turn.accepted"], "the turn itself is not rejected"


# -- who may send what ----------------------------------------------------------------------------

TEAM = AgentProfiles.model_validate(
    {"agents": [{"name": "lead", "agents": ["researcher"]}, {"name": "researcher"}]}
).agents


def asks_researcher(text: str) -> ModelResponse:
    call = ToolCall(id="call_1", name="researcher", arguments=json.dumps({"input": text}))
    message = ChatMessage(role="assistant", content=None, tool_calls=(call,))
    return ModelResponse(message=message, finish_reason="tool_calls")


async def parent_waiting(rig: Rig) -> TurnRequest:
    """The lead's turn ``t1`` parked on its researcher child; the child's request."""
    await rig.deliver(start(request("t1", agent="lead")))
    await rig.deliver(MemoryDelivery.of(rig.last_step()))
    [child] = [
        decode(p.body, TurnRequest)
        for p in rig.publisher.to(t.TURNS_QUEUE)
        if p.headers[t.H_KIND] == t.KIND_START
    ]
    assert child.parent is not None and child.parent.turn_id == "t1"
    return child


def forged_result(child: TurnRequest, content: str = "the forger's answer") -> TurnChildResult:
    assert child.parent is not None
    result = TurnResult(
        turn_id=child.turn_id,
        session_id=child.session_id,
        agent=child.agent,
        content=content,
        finish_reason="stop",
        parent=child.parent,
        steps=1,
        duration_s=0.1,
        completed_at=1.0,
    )
    return TurnChildResult(parent=child.parent, result=result)


def child_result(message: TurnChildResult, user_id: str | None) -> MemoryDelivery:
    headers = {t.H_KIND: t.KIND_CHILD_RESULT}
    return MemoryDelivery(encode(message), headers=headers, user_id=user_id)


async def test_a_child_result_from_no_worker_is_dead_lettered_and_the_real_one_answers(
    make_rig: MakeRig,
) -> None:
    rig = make_rig(
        asks_researcher("find A"), answers("facts on A"), answers("lead: facts on A"), agents=TEAM
    )
    child = await parent_waiting(rig)
    forged = forged_result(child)

    for user_id in (None, "mallory"):  # named no user, or a user of its own (RabbitMQ checked)
        delivery = await rig.deliver(child_result(forged, user_id))
        assert acked_once(delivery)

    codes = [letter.headers[t.H_REASON_CODE] for letter in rig.dead_letters.published]
    assert codes == ["forbidden", "forbidden"]
    assert "worker" in rig.dead_letters.published[1].headers[t.H_REASON]
    assert "mallory" in rig.dead_letters.published[1].headers[t.H_REASON]
    assert "turn.rejected" not in rig.event_types(), "a refused result rejects no turn"
    # the real child runs; the worker that finishes it sends its result as itself
    [child_start] = [
        p for p in rig.publisher.to(t.TURNS_QUEUE) if p.headers[t.H_KIND] == "turn.start"
    ]
    assert child_start.properties.user_id == WORKER
    await rig.deliver(MemoryDelivery.of(child_start))
    await rig.deliver(MemoryDelivery.of(rig.last_step()))
    real = rig.last_step()
    assert real.headers[t.H_KIND] == t.KIND_CHILD_RESULT and real.properties.user_id == WORKER
    await rig.deliver(MemoryDelivery.of(real))
    await rig.deliver(MemoryDelivery.of(rig.last_step()))  # merges the result
    await rig.deliver(MemoryDelivery.of(rig.last_step()))  # asks the model with it
    [result] = rig.replies()
    assert result.content == "lead: facts on A"
    tool_results = [m.content for m in rig.model.requests[2].messages if m.role == "tool"]
    assert tool_results == ["facts on A"]


async def test_a_child_result_that_is_not_the_calls_child_is_dead_lettered(
    make_rig: MakeRig,
) -> None:
    rig = make_rig(asks_researcher("find A"), agents=TEAM)
    child = await parent_waiting(rig)
    forged = forged_result(child)
    other = forged.model_copy(
        update={"result": forged.result.model_copy(update={"turn_id": "t1-other"})}
    )

    delivery = await rig.deliver(child_result(other, WORKER))

    assert acked_once(delivery)
    letter = only_dead_letter(rig)
    assert letter.headers[t.H_REASON_CODE] == "forbidden"
    assert "t1-other" in letter.headers[t.H_REASON]
    assert rig.store.controls.get((SESSION, "t1"), {}).keys() <= {"parked"}


async def test_a_child_turn_request_from_no_worker_is_dead_lettered_and_starts_nothing(
    make_rig: MakeRig,
) -> None:
    rig = make_rig(asks_researcher("find A"), agents=TEAM)
    child = await parent_waiting(rig)
    forged = child.model_copy(update={"turn_id": "t1-forged", "session_id": "s-forged"})
    sent = len(rig.publisher.to(t.TURNS_QUEUE))

    delivery = await rig.deliver(MemoryDelivery(encode(forged), user_id="mallory"))

    assert acked_once(delivery)
    assert only_dead_letter(rig).headers[t.H_REASON_CODE] == "forbidden"
    assert rig.event_types("t1-forged") == ["turn.rejected"]
    assert "s-forged" not in rig.store.turns
    # its "parent" is told nothing: no worker started that child
    assert len(rig.publisher.to(t.TURNS_QUEUE)) == sent


class AcceptFailsOnce(MemoryStore):
    """A memory store whose first ``accept`` finds Redis away."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    async def accept(self, request: TurnRequest) -> Any:
        if not self.failed:
            self.failed = True
            raise RedisConnectionError("Redis is away")
        return await super().accept(request)


@pytest.mark.parametrize(("sender", "vouched"), [(WORKER, WORKER), ("mallory", None)])
async def test_a_retried_message_carries_this_workers_voucher_only_for_a_workers_message(
    make_rig: MakeRig, sender: str, vouched: str | None
) -> None:
    rig = make_rig(store=AcceptFailsOnce())

    await rig.deliver(MemoryDelivery(encode(request("t1")), user_id=sender))

    [retry] = rig.retries()
    assert retry.properties.user_id == vouched
