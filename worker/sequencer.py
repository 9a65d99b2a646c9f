"""What a worker does with each work message, without any transport code.

``TurnWork.on_request`` accepts a ``TurnRequest`` (once per turn id) and queues it
behind the session's earlier turns; ``TurnWork.on_step`` takes the session's
lease, runs one step of its current turn and says what to publish next. The
transport (``worker.transport.consumer``) publishes the returned actions and only then
acks.

Ordering: a session's unfinished turns sit in a Redis list in arrival order;
only the head runs, and the worker that finishes it kicks the next one (the
finish and the pop are one script). A worker that finds the session leased by
another worker does not wait: the message goes to the delay queue (``Busy``).

Every ``Reply`` carries ``deliver(result)``: the publisher's copy of a result
(e.g. placeholders restored by the ``redact`` hook set), while the stored
result and the ``turn.completed`` event keep what the loop produced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from contracts.events import TurnAccepted, TurnFinished, finish_event_type, make_event
from contracts.messages import Usage
from contracts.state import AgentState
from contracts.turns import TurnError, TurnRequest, TurnResult
from contracts.work import StepWork
from worker import failpoints
from worker.agents import AgentProfile, AgentProfiles
from worker.errors import PermanentError
from worker.loop import EventSink, Finished, Loop, new_execution
from worker.session.leases import LeaseKeeper
from worker.session.store import RedisStore, SessionHandle

log = logging.getLogger("loopwire.turns")


@dataclass(frozen=True, slots=True)
class Step:
    """Publish this step message."""

    work: StepWork


@dataclass(frozen=True, slots=True)
class Reply:
    """Send the turn's result to the publisher's reply queue."""

    reply_to: str
    result: TurnResult


@dataclass(frozen=True, slots=True)
class Busy:
    """The session is leased by another worker: retry this message after a delay."""


@dataclass(frozen=True, slots=True)
class Drop:
    """Nothing to do (a duplicate or stale message): ack it."""

    reason: str
    code: str = "duplicate"
    """A fixed code for metrics: ``duplicate_request``, ``stale_step``, ``finished_turn``,
    ``missing_request``."""


Action = Step | Reply | Busy | Drop
LoopFactory = Callable[[SessionHandle, AgentProfile], Loop]
Deliver = Callable[[TurnResult], Awaitable[TurnResult]]


async def _as_is(result: TurnResult) -> TurnResult:
    return result


class TurnWork:
    def __init__(
        self,
        *,
        store: RedisStore,
        profiles: AgentProfiles,
        loop_factory: LoopFactory,
        events: EventSink,
        clock: Callable[[], float] = time.time,
        deliver: Deliver = _as_is,
    ) -> None:
        self.store = store
        self.profiles = profiles
        self.loop_factory = loop_factory
        self.events = events
        self.clock = clock
        self.deliver = deliver
        self.leases = LeaseKeeper(store)

    def profile(self, agent: str) -> AgentProfile:
        profile = self.profiles.get(agent)
        if profile is None:
            raise PermanentError(f"unknown agent {agent!r}", code="unknown_agent")
        return profile

    async def on_request(self, request: TurnRequest) -> list[Action]:
        self.profile(request.agent)
        accepted = await self.store.accept(request)
        if accepted.status == "done":
            assert accepted.result is not None
            replies: list[Action] = []
            if request.reply_to:
                replies.append(Reply(request.reply_to, await self.deliver(accepted.result)))
            return [*replies, Drop("duplicate turn request: already finished", "duplicate_request")]
        if accepted.status == "pending":
            # A duplicate of a turn not finished yet. The first delivery may have died between
            # accepting it and announcing or kicking it: announce again (same event id) and, if
            # it is the session's head, kick it again (a duplicate kick is dropped as stale).
            await self._emit_accepted(request)
            if await self.store.head(request.session_id) == request.turn_id:
                return [
                    Step(StepWork(session_id=request.session_id, turn_id=request.turn_id, step=0))
                ]
            return [Drop("duplicate turn request: still queued or running", "duplicate_request")]
        await self._emit_accepted(request)
        if accepted.status == "start":
            return [Step(StepWork(session_id=request.session_id, turn_id=request.turn_id, step=0))]
        return []

    async def on_step(self, work: StepWork) -> list[Action]:
        lease = await self.store.lease(work.session_id)
        if lease is None:
            return [Busy()]
        handle = self.store.handle(lease)
        del lease  # with the state it was read with: the handle hands that out once
        self.leases.hold(handle)
        try:
            return await self._step(handle, work)
        finally:
            self.leases.drop(handle)
            if not handle.released:
                await self.store.release(handle.lease)

    async def _step(self, handle: SessionHandle, work: StepWork) -> list[Action]:
        failpoints.hit("step_begin")
        state = handle.take_state()
        ex = state.execution if state else None
        if ex is None:
            head = await self.store.head(work.session_id)
            if head != work.turn_id or work.step != 0:
                return await self._already_done(work, head)
            request = await self.store.request(work.session_id, work.turn_id)
            if request is None:
                return [Drop(f"turn {work.turn_id} has no stored request", "missing_request")]
            profile = self.profile(request.agent)
            # not saved here: the turn's first save (its input) writes it
            state = new_execution(state, request, profile, self.clock())
            ex = state.execution
            assert ex is not None
        elif ex.turn_id != work.turn_id or work.step != len(ex.steps):
            if ex.turn_id == work.turn_id and ex.pending is None and work.step == len(ex.steps) - 1:
                # This step was saved, but the worker may have died before publishing the next
                # one: publish it again (a duplicate of it is dropped as stale).
                following = StepWork(
                    session_id=work.session_id, turn_id=work.turn_id, step=work.step + 1
                )
                return [Step(following)]
            return [Drop(f"stale step message {work.turn_id}#{work.step}", "stale_step")]
        assert state is not None
        request = ex.request
        profile = self.profile(request.agent)
        stepping = self.loop_factory(handle, profile).step(state, profile)
        # The loop saves new copies of the state as it goes; the ones read or built here are not
        # kept while the model thinks (about 2 KB per turn in flight at a turn's first step).
        del state, ex
        outcome = await stepping
        if isinstance(outcome, Finished):
            reply = await self.deliver(outcome.result) if request.reply_to else outcome.result
            return self._finish_actions(reply, request, handle.next_turn)
        next_ex = outcome.state.execution
        assert next_ex is not None
        failpoints.hit("step_saved")
        return [
            Step(
                StepWork(session_id=work.session_id, turn_id=work.turn_id, step=len(next_ex.steps))
            )
        ]

    async def fail_turn(self, work: StepWork, code: str, reason: str) -> list[Action]:
        """End the turn of a step that can never succeed (``finish_reason: error``), so that its
        publisher hears of it and the session's next turn can run."""
        lease = await self.store.lease(work.session_id)
        if lease is None:
            return [Busy()]
        handle = self.store.handle(lease)
        try:
            state = lease.state
            ex = state.execution if state else None
            if ex is not None and ex.turn_id != work.turn_id:
                return [Drop(f"stale step message {work.turn_id}#{work.step}", "stale_step")]
            request = ex.request if ex else await self.store.request(work.session_id, work.turn_id)
            if request is None:
                return [Drop(f"turn {work.turn_id} is not waiting to run", "missing_request")]
            now = self.clock()
            result = TurnResult(
                turn_id=work.turn_id,
                session_id=work.session_id,
                agent=request.agent,
                content=ex.last_content if ex else None,
                finish_reason="error",
                error=TurnError(code=code[:64], message=reason[:4000]),
                usage=ex.usage if ex else Usage(),
                steps=len(ex.steps) if ex else 0,
                duration_s=max(0.0, now - ex.started_at) if ex else 0.0,
                completed_at=now,
            )
            base = state or AgentState(
                session_id=work.session_id, agent=request.agent, created_at=now, updated_at=now
            )
            final = base.model_copy(
                update={
                    "execution": None,
                    "execution_count": base.execution_count + (1 if ex else 0),
                    "updated_at": now,
                }
            )
            await handle.save(final, result=result)
            await self._emit_finished(result)
            reply = await self.deliver(result) if request.reply_to else result
            return self._finish_actions(reply, request, handle.next_turn)
        finally:
            if not handle.released:
                await self.store.release(lease)

    async def _emit_finished(self, result: TurnResult) -> None:
        event = make_event(
            finish_event_type(result.finish_reason),
            TurnFinished(result=result),
            agent=result.agent,
            time=result.completed_at,
            turn_id=result.turn_id,
            session_id=result.session_id,
        )
        try:
            await self.events.emit(event)
        except Exception:
            log.exception("could not publish the end of turn %s", result.turn_id)

    async def _already_done(self, work: StepWork, head: str | None) -> list[Action]:
        """A step message for a turn that is not running: a duplicate, or the redelivered last
        step of a finished turn whose effects (reply, event, next kick) may not have gone out."""
        result = await self.store.result(work.session_id, work.turn_id)
        if result is None or work.step < max(result.steps - 1, 0):
            return [Drop(f"stale step message {work.turn_id}#{work.step}", "stale_step")]
        reply_to = await self.store.reply_to(work.session_id, work.turn_id)
        await self._emit_finished(result)
        actions: list[Action] = []
        if reply_to:
            actions.append(Reply(reply_to, await self.deliver(result)))
        if head is not None and head != work.turn_id:
            actions.append(Step(StepWork(session_id=work.session_id, turn_id=head, step=0)))
        return [*actions, Drop("finished turn: effects repeated", "finished_turn")]

    def _finish_actions(
        self, result: TurnResult, request: TurnRequest, next_turn: str | None
    ) -> list[Action]:
        actions: list[Action] = []
        if request.reply_to:
            actions.append(Reply(request.reply_to, result))
        if next_turn is not None:
            actions.append(Step(StepWork(session_id=request.session_id, turn_id=next_turn, step=0)))
        return actions

    async def _emit_accepted(self, request: TurnRequest) -> None:
        event = make_event(
            "turn.accepted",
            TurnAccepted(persist=request.persist, input_messages=len(request.input)),
            agent=request.agent,
            time=self.clock(),
            turn_id=request.turn_id,
            session_id=request.session_id,
        )
        try:
            await self.events.emit(event)
        except Exception:
            log.exception("could not publish turn.accepted for %s", request.turn_id)
