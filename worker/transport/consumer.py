"""The transport around the ``SessionSequencer``: decode, dispatch, publish, then settle the
delivery — in one place (``Consumer._settle``): an ack, after a delayed retry or a dead-letter
where due.

- Bad input (undecodable, oversize, wrong schema, hostile ids, unknown agent) is
  published to the dead-letter exchange with ``x-loopwire-reason`` and
  ``x-loopwire-reason-code`` headers on its first delivery, and acked. A rejected turn
  request is answered with a ``TurnRejection`` on the reply queue it names (its body's
  ``reply_to``, else the AMQP property) and announced as ``turn.rejected`` when its turn id
  can be read (its body's, else its ``message_id``); any other message (a step, a control
  message, a kind this worker does not know) rejects no turn.
- Transient failures (Redis down, a Redis Cluster slot without a master during a
  failover, a lost lease race) send the message to the
  delay queue and ack it: the work is never lost and no worker blocks.
- An unexpected error in a step is retried through the delay queue up to
  ``max_step_attempts`` times, then dead-lettered with the error as reason; a
  message redelivered ``poison_after`` times (it keeps killing workers) is
  dead-lettered before the broker's own delivery limit does it without a
  reason. A dead-lettered *step* ends its turn with ``finish_reason: error``
  (``turn.failed``, a reply to the publisher) so the session's next turn runs.
- Who may send what (``worker.transport.senders``): a child turn's request or result that
  no worker sent is dead-lettered (``forbidden``).
- Every publish uses confirms; the message is acked only after all of them.
- A step starts only while every channel of the broker connection is open; a step whose
  channel went down goes back to the queue and is redone. A connection that drops does not
  cut the step in hand short: it runs up to its next use of the broker, saving what arrives
  meanwhile (a model answer), so the next delivery does not ask for it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from aio_pika.exceptions import AMQPError
from aiormq.exceptions import ChannelInvalidStateError
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisClusterException, RedisError

from contracts import tenancy
from contracts import topology as t
from contracts.base import SAFE_ID_PATTERN
from contracts.codec import DecodeError, decode
from contracts.control import TurnCancel, TurnChildResult, TurnDecision
from contracts.runtime.tracing import header_traceparent, header_tracestate
from contracts.sessions import SessionDelete
from contracts.turns import TurnRequest
from contracts.work import StepWork
from worker.errors import PermanentError, RetryableError, StaleStateError
from worker.loop import EventSink
from worker.runtime import failpoints
from worker.runtime.metrics import WorkerMetrics
from worker.sequencing.actions import Action, Answer, Busy, Control, Delay, Drop, Reply, Start, Step
from worker.sequencing.sequencer import SessionSequencer
from worker.transport.delivery import (
    channel_closed,
    child_request,
    count,
    step_work,
    taken_before,
)
from worker.transport.outbox import Outbox
from worker.transport.publish import Publisher, properties
from worker.transport.refusals import announce_rejected
from worker.transport.senders import Senders
from worker.transport.tenants import Tenants

log = logging.getLogger("loopwire.consumer")
_SAFE_ID = re.compile(SAFE_ID_PATTERN)


@dataclass(frozen=True, slots=True)
class Ack:
    """The work is done (or there is nothing to do): ack."""


@dataclass(frozen=True, slots=True)
class Retry:
    """Send the message to the delay queue, then ack; ``failed``: the attempt counts."""

    reason: str
    failed: bool = False


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Dead-letter the message with a reason (a step's turn is ended first), then ack."""

    reason: str
    code: str


Settlement = Ack | Retry | DeadLetter


class Consumer:
    def __init__(
        self,
        *,
        work: SessionSequencer,
        publisher: Publisher,
        dead_letters: Publisher,
        events: EventSink,
        busy_retry_s: float = 0.5,
        max_step_attempts: int = 5,
        poison_after: int = t.TURN_DELIVERY_LIMIT - 2,
        metrics: WorkerMetrics | None = None,
        broker_up: asyncio.Event | None = None,
        in_flight: set[asyncio.Task[Any]] | None = None,
        user: str | None = None,
        workers: Collection[str] = (),
        tenants: Tenants | None = None,
        intake: Publisher | None = None,
        lanes: frozenset[str] = frozenset(),
    ) -> None:
        self.metrics = metrics if metrics is not None else WorkerMetrics(CollectorRegistry())
        self.work = work
        self.publisher = publisher
        """Confirmed publishes to the default exchange: next steps, replies, retries."""
        self.senders = Senders(user, workers)
        self.tenants = tenants if tenants is not None else Tenants()
        """Whose each message is (off unless the worker's settings turn tenancy on)."""
        self.outbox = Outbox(publisher, user, intake, lanes)
        """What the work publishes; a tenant's of ``lanes`` to its intake through ``intake``."""
        self.dead_letters = dead_letters
        """Confirmed publishes to the dead-letter exchange."""
        self.events = events
        self.busy_retry_s = busy_retry_s
        self.max_step_attempts = max_step_attempts
        self.poison_after = poison_after
        if broker_up is None:
            broker_up = asyncio.Event()
            broker_up.set()
        self.broker_up = broker_up
        """Set while every channel of the broker connection is open (see ``BrokerGate``)."""
        self.in_flight = in_flight if in_flight is not None else set()
        """The tasks handling a message right now (a worker stopping waits for them)."""
        self.handled = 0
        """Messages taken so far."""

    async def handle(self, message: AbstractIncomingMessage) -> None:
        """Handle one work message: every path ends in exactly one ack (after a delayed retry
        or a dead-letter where due), or in the message going back to the queue when a channel
        went down under it.

        The work runs in a task of its own. When the broker connection drops, the client
        cancels the callbacks of the deliveries it had made; the step goes on without its
        callback up to its next use of the broker, which fails: so a model answer on its way
        is still saved (Redis and the lease suffice) before the step goes back, and the
        broker's next delivery of the message goes on from it instead of asking again."""
        self.handled += 1
        task = asyncio.create_task(self._handle(message))
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)
        await asyncio.shield(task)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        try:
            if not self.broker_up.is_set():
                await self.broker_up.wait()
                if channel_closed(message):
                    return  # the broker delivers it again: no step for a delivery that is gone
            headers: dict[str, Any] = message.headers  # read only: a step holds it to its end
            try:
                lane = t.intake_tenant(message.exchange, message.routing_key)
                tenant = self.tenants.of(message.user_id, headers, lane)
            except PermanentError as exc:
                await self._settle(message, headers, DeadLetter(str(exc), exc.code))
                return
            with tenancy.acting_for(tenant):  # every key, header and event of the work
                settlement = await self._work(message, headers)
                await self._settle(message, headers, settlement)
        except (AMQPError, ChannelInvalidStateError, ConnectionError) as exc:
            await self._give_back(message, exc)

    async def _work(self, message: AbstractIncomingMessage, headers: dict[str, Any]) -> Settlement:
        """Do what the message asks, publishing what follows; say how to settle it."""
        try:
            deliveries = count(headers, "x-delivery-count")
            count(headers, t.H_ATTEMPT)
            if deliveries >= self.poison_after:
                raise PermanentError(
                    f"delivered {deliveries + 1} times without being done (it may crash workers)",
                    code="poison",
                )
            redone = taken_before(message, headers)
            actions = await self._dispatch(message.body, headers, redone, message.user_id)
            return await self._perform(actions)
        except DecodeError as exc:
            return DeadLetter(exc.reason, exc.code)
        except PermanentError as exc:
            return DeadLetter(str(exc), exc.code)
        except (AMQPError, ChannelInvalidStateError):
            raise  # the broker connection went down mid-step: redelivered once it is back
        except StaleStateError as exc:
            log.warning(
                "abandoned work message %s: %s (another worker holds the session; the step is "
                "redone from its last save)",
                message.message_id,
                exc,
            )
            self.metrics.steps_abandoned.labels("stale_state").inc()
            return Retry("transient")
        except (RetryableError, RedisError, RedisClusterException, ConnectionError) as exc:
            log.warning("retrying work after a transient failure: %s", exc)
            return Retry("transient")
        except Exception as exc:
            log.exception("step failed")
            attempt = count(headers, t.H_ATTEMPT) + 1
            if attempt >= self.max_step_attempts:
                return DeadLetter(
                    f"step failed {attempt} times: {type(exc).__name__}: {exc}", "step_failed"
                )
            return Retry("failed", failed=True)

    async def _dispatch(
        self, body: bytes, headers: dict[str, Any], redone: bool = False, sender: str | None = None
    ) -> list[Action]:
        """What the sequencer makes of the message, by its kind; ``redone``: it was taken
        before (redelivered, or sent again after a failure); ``sender``: its ``user_id``."""
        kind = headers.get(t.H_KIND, t.KIND_START)
        if kind == t.KIND_STEP:
            work = decode(body, StepWork)
            with self.metrics.steps_in_progress.track_inprogress():
                return await self.work.on_step(work, redone=redone)
        if kind == t.KIND_START:
            request = decode(body, TurnRequest)
            self.senders.vet_request(request, sender)
            parent = header_traceparent(headers)
            if parent is not None:  # W3C trace context: the header wins over the body
                request = request.model_copy(
                    update={"traceparent": parent, "tracestate": header_tracestate(headers)}
                )
            return await self.work.on_request(request)
        if kind == t.KIND_CANCEL:
            return await self.work.on_cancel(decode(body, TurnCancel))
        if kind == t.KIND_DECISION:
            return await self.work.on_decision(decode(body, TurnDecision))
        if kind == t.KIND_CHILD_RESULT:
            message = decode(body, TurnChildResult)
            self.senders.vet_child_result(message, sender)
            return await self.work.on_child_result(message)
        if kind == t.KIND_SESSION_DELETE:
            return await self.work.on_session_delete(decode(body, SessionDelete))
        raise DecodeError(f"unknown message kind {str(kind)[:64]!r}", code="unknown_kind")

    async def _settle(
        self, message: AbstractIncomingMessage, headers: dict[str, Any], settlement: Settlement
    ) -> None:
        """The one place a delivery is settled. A dead-letter whose turn cannot be ended now
        (the session is busy, Redis is away) becomes a delayed retry: the message comes back
        and is judged again."""
        if isinstance(settlement, DeadLetter):
            settlement = await self._dead_letter(message, settlement) or Ack()
        if isinstance(settlement, Retry):
            await self._retry(message, headers, settlement)
        failpoints.hit("before_ack")
        await message.ack()

    async def _perform(self, actions: list[Action]) -> Settlement:
        settlement: Settlement = Ack()
        for action in actions:
            if isinstance(action, Step | Reply | Delay | Start | Control | Answer):
                await self.outbox.send(action)
            elif isinstance(action, Busy):
                log.debug("session busy; retrying later")
                settlement = Retry("busy")
            elif isinstance(action, Drop):
                log.debug("dropping work: %s", action.reason)
                self.metrics.scoped(self.metrics.dropped, action.code).inc()
        return settlement

    async def _retry(
        self, message: AbstractIncomingMessage, headers: dict[str, Any], retry: Retry
    ) -> None:
        attempt = count(headers, t.H_ATTEMPT, bad=0) + (1 if retry.failed else 0)
        # work that was taken (not only found busy) comes back as taken before: a step it
        # saved publishes what followed it again
        redone = retry.reason != "busy" or taken_before(message, headers)
        # One delay for every retry: messages in the delay queue expire in order, so a longer
        # backoff would hold back the short retries queued behind it.
        await self.publisher.publish(
            message.body,
            routing_key=t.RETRY_QUEUE,
            mandatory=True,
            properties=properties(
                content_type=message.content_type,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                headers={
                    **headers,
                    t.H_ATTEMPT: attempt,
                    **({t.H_REDONE: True} if redone else {}),
                    **tenancy.headers(),
                },
                message_id=message.message_id,
                correlation_id=message.correlation_id,
                reply_to=message.reply_to,
                expiration_ms=int(self.busy_retry_s * 1000),
                # the tenant the worker resolved, under its own user: it vouches for it now
                user_id=self.senders.user
                if tenancy.current() is not None
                else self.senders.voucher(message.user_id),
            ),
        )
        self.metrics.retried.labels(retry.reason).inc()

    async def _dead_letter(
        self, message: AbstractIncomingMessage, letter: DeadLetter
    ) -> Retry | None:
        """Dead-letter the message; a step message's turn is ended first (``error``) so that its
        publisher hears of it and the session's next turn runs. ``Retry`` when that cannot be
        done now."""
        headers = dict(message.headers or {})
        reason = letter.reason.replace("\n", " ")[:1000]
        step = step_work(message.body) if headers.get(t.H_KIND) == t.KIND_STEP else None
        if step is not None:
            try:
                ended = await self._perform(await self.work.fail_turn(step, letter.code, reason))
            except (AMQPError, ChannelInvalidStateError):
                raise  # the broker went down: the delivery is given back and judged again
            except (RetryableError, RedisError, RedisClusterException, ConnectionError) as exc:
                log.warning("could not end the turn of a dead step now, retrying: %s", exc)
                return Retry("transient")
            except Exception:
                # a defect: the letter still goes out with its reason, and the log says why
                log.exception("could not end the turn of a dead step %s", step.turn_id)
                ended = Ack()
            if isinstance(ended, Retry):
                return ended
        child = (
            child_request(message.body)
            if headers.get(t.H_KIND, t.KIND_START) == t.KIND_START and letter.code != "forbidden"
            else None
        )
        if child is not None:  # its parent waits for it: it hears of the rejection (a request
            # refused as forbidden came from no worker: its parent started no such child)
            await self._perform(self.work.on_refused(child, letter.code, reason))
        log.warning("dead-lettering work (%s): %s", letter.code, reason)
        await self.dead_letters.publish(
            message.body,
            routing_key=t.TURNS_QUEUE,
            properties=properties(
                content_type=message.content_type,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                headers={
                    **headers,
                    t.H_DEAD_ID: uuid.uuid4().hex[:16],
                    t.H_REASON: reason,
                    t.H_REASON_CODE: letter.code,
                    t.H_REJECTED_AT: time.time(),
                },
                message_id=message.message_id,
                correlation_id=message.correlation_id,
                reply_to=message.reply_to,
                user_id=self.senders.voucher(message.user_id),
            ),
        )
        self.metrics.dead_letter(letter.code)
        if headers.get(t.H_KIND, t.KIND_START) == t.KIND_START:
            # a turn request's turn is rejected; any other message (a step, a control message,
            # one of a kind this worker does not know) rejects no turn
            await announce_rejected(
                message,
                reason,
                letter.code,
                outbox=self.outbox,
                events=self.events,
                tenants=self.tenants,
            )
        return None

    async def _give_back(self, message: AbstractIncomingMessage, exc: BaseException) -> None:
        """A channel went down under the work. On a closed delivery channel there is nothing
        to ack on: the broker delivers the message again. A delivery channel that is still
        open (restored before the others, or another channel was lost alone) would hold the
        message unacked for good: it is returned to the queue once the connection is whole."""
        if channel_closed(message):
            log.warning(
                "could not finish work message %s, the broker connection is down (%r): "
                "it will be delivered again",
                message.message_id,
                exc,
            )
            return
        log.warning(
            "could not finish work message %s, a channel went down (%r): "
            "it goes back to the queue once the connection is whole",
            message.message_id,
            exc,
        )
        await self.broker_up.wait()
        await asyncio.sleep(self.busy_retry_s)  # a channel lost alone restores itself meanwhile
        # should the delivery channel go down too, the broker delivers the message again
        with contextlib.suppress(AMQPError, ChannelInvalidStateError, ConnectionError):
            await message.nack(requeue=True)
