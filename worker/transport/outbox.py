"""What the sequencer asks to publish, on the wire: the next step, a reply to a publisher (a
result, a session read's answer, a refused request's rejection), a parked turn's timeout through the wait queues, a child turn's request, the control
messages between parents and children, and the deletion of a deleted session's children.
Every publish is confirmed (``Publisher``); the consumer acks the work message only after all
of them. Turn work carries ``user_id`` = the worker's own AMQP user (``user``), validated by
RabbitMQ: what vouches for a child's request and a child's result
(``worker.transport.consumer``); while tenancy is on, it also carries the tenant the work is
for (``x-loopwire-tenant``), which the next worker takes because a worker's user sent it, and
what would go to ``loopwire.turns`` for a tenant with an intake queue of its own goes there
(through the intake exchange, worker/transport/intake.py), so that a tenant's steps queue
behind its own work only."""

from __future__ import annotations

import time

import aio_pika

from contracts import tenancy
from contracts import topology as t
from contracts.base import Contract
from contracts.codec import encode
from contracts.control import TurnChildResult
from contracts.runtime.tracing import TRACEPARENT, TRACESTATE
from contracts.sessions import SessionDelete
from contracts.turns import TurnRejection
from contracts.work import StepWork
from worker.sequencing.actions import Answer, Control, Delay, Reply, Start, Step
from worker.transport.publish import Publisher, properties


class Outbox:
    def __init__(
        self,
        publisher: Publisher,
        user: str | None = None,
        intake: Publisher | None = None,
        lanes: frozenset[str] = frozenset(),
    ) -> None:
        self.publisher = publisher
        self.user = user
        self.intake = intake
        """Confirmed publishes to the intake exchange, for the tenants of ``lanes``."""
        self.lanes = lanes

    async def send(self, action: Step | Reply | Delay | Start | Control | Answer) -> None:
        if isinstance(action, Answer):
            await self.answer(action.reply_to, action.correlation_id, action.body)
        elif isinstance(action, Step):
            await self.publish_step(action.work)
        elif isinstance(action, Reply):
            await self.publisher.publish(
                encode(action.result),
                routing_key=action.reply_to,
                properties=properties(
                    content_type=t.CONTENT_TYPE,
                    delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
                    correlation_id=action.result.turn_id,
                    message_type="turn.result",
                ),
            )
        elif isinstance(action, Delay):
            await self.publish_wait(action.work)
        else:
            await self.publish_turn_message(action)

    async def answer(self, reply_to: str, correlation_id: str, body: Contract) -> None:
        """An answer to a request (a ``SessionReply``), to its reply queue."""
        await self.publisher.publish(
            encode(body),
            routing_key=reply_to,
            properties=properties(
                content_type=t.CONTENT_TYPE,
                delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
                correlation_id=correlation_id,
                message_type="session.reply",
            ),
        )

    async def reject(
        self, reply_to: str, rejection: TurnRejection, correlation_id: str | None
    ) -> None:
        """A refused turn request's ``TurnRejection``, to the reply queue its publisher waits on."""
        await self.publisher.publish(
            encode(rejection),
            routing_key=reply_to,
            properties=properties(
                content_type=t.CONTENT_TYPE,
                delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
                correlation_id=correlation_id,
                message_type="turn.rejection",
            ),
        )

    async def publish_step(self, work: StepWork) -> None:
        await self._work(work, t.TURNS_QUEUE, t.KIND_STEP, f"{work.turn_id}:{work.step}")

    async def publish_turn_message(self, action: Start | Control) -> None:
        """A child turn's request, a child's result for its parent, a cancel for a child, the
        deletion of a child session."""
        body: Contract
        trace: dict[str, str] = {}
        if isinstance(action, Start):
            body, kind, message_id = action.request, t.KIND_START, action.request.turn_id
            if action.request.traceparent is not None:  # the header says it too
                trace[TRACEPARENT] = action.request.traceparent
                if action.request.tracestate:
                    trace[TRACESTATE] = action.request.tracestate
        elif isinstance(action.message, TurnChildResult):
            message = action.message
            body, kind = message, t.KIND_CHILD_RESULT
            message_id = f"{message.parent.turn_id}:{message.parent.call_id}:result"
        elif isinstance(action.message, SessionDelete):
            body, kind = action.message, t.KIND_SESSION_DELETE
            message_id = f"{action.message.session_id}:delete"
        else:
            body, kind = action.message, t.KIND_CANCEL
            message_id = f"{action.message.turn_id}:cancel"
        await self._work(body, t.TURNS_QUEUE, kind, message_id, trace)

    async def publish_wait(self, work: StepWork) -> None:
        """A parked turn's timeout message, through the wait queue whose delay fits best (it
        hops on until it is due, then comes back to ``loopwire.turns``)."""
        assert work.wait_until is not None
        bucket = t.wait_bucket(work.wait_until - time.time())
        await self._work(
            work, t.wait_queue(bucket), t.KIND_STEP, f"{work.turn_id}:{work.step}:wait"
        )

    async def _work(
        self,
        body: Contract,
        queue: str,
        kind: str,
        message_id: str,
        trace: dict[str, str] | None = None,
    ) -> None:
        """Turn work, persistent, to ``queue`` (mandatory: a queue that is gone fails it)."""
        publisher = self.publisher
        if queue == t.TURNS_QUEUE and self.intake is not None:
            tenant = tenancy.current()
            if tenant is not None and tenant in self.lanes:
                publisher, queue = self.intake, t.intake_key(tenant)
        await publisher.publish(
            encode(body),
            routing_key=queue,
            mandatory=True,
            properties=properties(
                content_type=t.CONTENT_TYPE,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                headers={t.H_KIND: kind, **(trace or {}), **tenancy.headers()},
                message_id=message_id,
                user_id=self.user,
            ),
        )
