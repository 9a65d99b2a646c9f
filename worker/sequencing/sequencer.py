"""Sequences a session's turns: what a worker does with each work message, without any
transport code.

``SessionSequencer.on_request`` accepts a ``TurnRequest`` (once per turn id) and queues it
behind the session's earlier turns; ``on_step`` takes the session's lease, runs one step of
its current turn and says what to publish next; ``fail_turn`` ends the turn of a step that
can never succeed. The transport (``worker.transport.consumer``) publishes the returned
actions and only then acks.

Ordering: a session's unfinished turns sit in a Redis list in arrival order;
only the head runs, and the worker that finishes it kicks the next one (the
finish and the pop are one script). A worker that finds the session leased by
another worker does not wait: the message goes to the delay queue (``Busy``).

Control messages and parked turns are handled by the ``Controls`` half (``worker.sequencing.controls``).
A child turn's end sends its result to its parent (``turn.child_result``); a turn that ends
while children are out cancels them (``turn.cancel``).

Every ``Reply`` carries ``deliver(result)``: the publisher's copy of a result
(e.g. placeholders restored by the ``redact`` hook set), while the stored
result and the ``turn.completed`` event keep what the loop produced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from contracts.state import AgentState, ExecutionState, TurnTrace
from contracts.turns import TurnError, TurnRequest, TurnResult
from contracts.work import StepWork
from worker.errors import PermanentError
from worker.loop import EventSink, Finished, Loop, StepOutcome, Waiting, new_execution
from worker.loop.announce import announce_ended_step
from worker.loop.output import check_schema
from worker.loop.ports import LoopObserver
from worker.loop.turn import turn_of
from worker.profiles.agents import AgentProfile, ProfileLookup
from worker.runtime import failpoints
from worker.runtime.tracing import Tracing
from worker.sequencing.actions import (
    Action,
    Busy,
    Drop,
    Step,
    cancel_children,
    first_step,
    to_parent,
)
from worker.sequencing.announcing import Announcing, answers
from worker.sequencing.controls import Controls
from worker.sequencing.erasure import Erasure, Forget
from worker.sequencing.throttling import Throttling
from worker.session.leases import LeaseKeeper
from worker.session.port import Opening, SessionStore, StepSession
from worker.session.records import SessionRecords
from worker.session.tenant_slots import TenantSlots

log = logging.getLogger("loopwire.sequencer")

LoopFactory = Callable[[StepSession, AgentProfile, bool], Loop]
"""The loop of one step: its session, the agent, whether the step may have run before."""
Deliver = Callable[[TurnResult], Awaitable[TurnResult]]


async def _as_is(result: TurnResult) -> TurnResult:
    return result


class SessionSequencer(Announcing, Throttling, Controls, Erasure):
    def __init__(
        self,
        *,
        store: SessionStore,
        leases: LeaseKeeper,
        profiles: ProfileLookup,
        loop_factory: LoopFactory,
        events: EventSink,
        clock: Callable[[], float] = time.time,
        deliver: Deliver = _as_is,
        observer: LoopObserver | None = None,
        records: SessionRecords | None = None,
        forget: Forget | None = None,
        tracing: Tracing | None = None,
        slots: TenantSlots | None = None,
    ) -> None:
        self.slots = slots
        """Tenants' caps on running turns (none: no cap)."""
        self.tracing = tracing
        """Spans of turns and steps, when tracing is on."""
        self.records = records
        """The session's records, for deleting a session (none: deletions are refused)."""
        self.forget = forget
        """Forgets a deleted session's memories, where a memory store is configured."""
        self.observer = observer or LoopObserver()
        """Hears of the turns ended here rather than by a loop (a queued turn cancelled)."""
        self.store = store
        self.leases = leases
        self.profiles = profiles
        self.loop_factory = loop_factory
        self.events = events
        self.clock = clock
        self.deliver = deliver

    def profile(self, agent: str) -> AgentProfile:
        profile = self.profiles.get(agent)
        if profile is None:
            raise PermanentError(f"unknown agent {agent!r}", code="unknown_agent")
        return profile

    async def on_request(self, request: TurnRequest) -> list[Action]:
        self.profile(request.agent)
        if request.output_schema is not None:
            try:
                check_schema(request.output_schema)
            except ValueError as exc:
                raise PermanentError(f"output_schema: {exc}", code="schema") from None
        accepted = await self.store.accept(request)
        if accepted.status == "in_use":
            raise PermanentError(
                f"turn id {request.turn_id} is in use: another session accepted it (turn ids "
                "are unique across sessions)",
                code="turn_id_in_use",
            )
        if accepted.status == "erasing":
            return [Busy()]  # the session is being deleted: the request comes back after
        if accepted.status == "done":
            assert accepted.result is not None
            # announced again too (the same event, the same bytes), so the copy's publisher
            # sees the turn end on the events exchange as well; its last step first (the
            # worker that ended it may still be publishing that step's events)
            state = await self.store.stored_state(request.session_id)
            await announce_ended_step(self.events, accepted.result, state)
            await self._emit_finished(accepted.result)
            reply_to = (request.reply_to,) if request.reply_to else ()
            replies = await answers(self.deliver, accepted.result, reply_to)
            # a child's parent hears of it again (the worker that finished it may have died
            # before it could tell; a copy is dropped there)
            replies += to_parent(accepted.result)
            return [*replies, Drop("duplicate turn request: already finished", "duplicate_request")]
        if accepted.status == "pending":
            # A duplicate of a turn not finished yet. The first delivery may have died between
            # accepting it and announcing or kicking it: announce again (same event id) and, if
            # it is the session's head, kick it again (a duplicate kick is dropped as stale).
            await self._emit_accepted(request, accepted.accepted_at)
            # a child whose parent has ended: the first delivery may have died before it
            # cancelled it
            orphaned = await self._orphaned(request)
            if await self.store.head(request.session_id) == request.turn_id:
                return [first_step(request.session_id, request.turn_id), *orphaned]
            drop = Drop("duplicate turn request: still queued or running", "duplicate_request")
            return [*orphaned, drop]
        await self._emit_accepted(request, accepted.accepted_at)
        kick = (
            [first_step(request.session_id, request.turn_id)] if accepted.status == "start" else []
        )
        return [*kick, *await self._orphaned(request)]

    async def on_step(self, work: StepWork, *, redone: bool = False) -> list[Action]:
        """Run one step of ``work``'s turn; ``redone``: its message was taken before (a
        streamed answer's first delta says ``restarted``). Only a redone message of a step
        that was done publishes what followed it again (the next step; a finished turn's
        reply, end and next turn): it may not have gone out."""
        first = work.step == 0 and work.wait_until is None
        session = await self.store.take(work.session_id, work.turn_id, first=first)
        if session is None:
            return [Busy()]
        task = asyncio.current_task()
        assert task is not None
        abandoned = False

        def cancelled() -> None:
            # a renewal found the turn cancelled while its step waits for the model or a tool
            nonlocal abandoned
            abandoned = True
            task.cancel()

        self.leases.hold(session, f"{work.turn_id}#{work.step}", cancelled)
        try:
            return await self._run(session, work, cancelled, redone)
        except asyncio.CancelledError:
            if not abandoned or task.cancelling() > 1:
                raise  # the worker is stopping
            task.uncancel()
            # the call in flight is abandoned; the step message again ends the turn from its
            # last save, under the lease, with what it had
            return [Step(work)]
        finally:
            self.leases.drop(session)
            if not session.released:
                await self.store.release(session)

    async def _run(
        self, session: StepSession, work: StepWork, abandon: Callable[[], None], redone: bool
    ) -> list[Action]:
        failpoints.hit("step_begin")
        ready = await self._resolve(session, work, redone)
        if isinstance(ready, list):
            return ready
        if self.tracing is None:
            return [*ready.also, *await self._stepped(ready, session, work, abandon)]
        with self.tracing.step(ready.trace, ready.request, work.step):
            return [*ready.also, *await self._stepped(ready, session, work, abandon)]

    async def _stepped(
        self, ready: _Stepping, session: StepSession, work: StepWork, abandon: Callable[[], None]
    ) -> list[Action]:
        deadline = ready.request.deadline
        timer = None
        if deadline is not None and deadline > self.clock():  # then abandoned as if cancelled
            timer = asyncio.get_running_loop().call_later(
                max(0.0, deadline - self.clock()), abandon
            )
        try:
            outcome = await ready.stepping
        finally:
            if timer is not None:
                timer.cancel()
        if isinstance(outcome, Waiting):
            await self.note_children(work.session_id, outcome.start)
            return self._waiting(outcome, work, session)
        if ready.waited:
            await self.store.clear_approvals(work.turn_id, ready.waited)
        if isinstance(outcome, Finished):
            return await self._finished(outcome, ready.request, session)
        if session.cancel is not None and not session.released:
            # a save of the step found its turn cancelled before any tool went out: it ends
            # now, under the lease, from that save
            return await self._end_cancelled(session, outcome.state, work, session.cancel)
        next_ex = outcome.state.execution
        assert next_ex is not None
        failpoints.hit("step_saved")
        return [
            Step(
                StepWork(session_id=work.session_id, turn_id=work.turn_id, step=next_ex.step_count)
            )
        ]

    async def _resolve(
        self, session: StepSession, work: StepWork, redone: bool = False
    ) -> _Stepping | list[Action]:
        """What this step message asks for: the step to run (its loop already holding the
        state), or what to do instead (a stale or duplicate message, a finished turn)."""
        state = session.take_state()
        ex = state.execution if state else None
        cancel = session.cancel
        opening = session.opening
        also: list[Action] = []
        if cancel is not None and await self._runs(ex, work, opening):
            return await self._end_cancelled(session, state, work, cancel)
        if ex is None:
            head = await self._head(work, opening)
            if head != work.turn_id or work.step != 0:
                return await self._already_done(work, head, redone, state)
            request = (
                opening.request
                if opening
                else await self.store.request(work.session_id, work.turn_id)
            )
            if request is None:
                return [Drop(f"turn {work.turn_id} has no stored request", "missing_request")]
            runs, also = await self._take_slot(work, request)
            if not runs:
                return also
            # not saved here: the turn's first save (its input) writes it
            state = new_execution(state, request, self.profile(request.agent), self.clock())
            if self.tracing is not None:
                state = self.tracing.begin(state)
        elif ex.turn_id != work.turn_id:
            # another turn of the session runs: this one is over (its effects are repeated
            # when this message was taken before and its turn's result is stored: the worker
            # that ended it may have died before announcing and replying) or never ran; the
            # running turn was started by whoever started it, so it is not kicked again
            return await self._already_done(work, None, redone, state)
        elif work.step != ex.step_count:
            if (
                redone
                and ex.turn_id == work.turn_id
                and ex.pending is None
                and work.step == ex.step_count - 1
            ):
                # This step was saved, but the worker may have died (or failed) before
                # publishing the next one: publish it again (a duplicate of it is dropped as
                # stale). A copy that is no redelivery (a second wake, a late timeout) found
                # the step done by the one that did it, which published what follows.
                return [Step(work.model_copy(update={"step": work.step + 1, "wait_until": None}))]
            return [Drop(f"stale step message {work.turn_id}#{work.step}", "stale_step")]
        else:
            assert state is not None  # it has a turn attached
            request = ex.request
            if ex.status == "waiting":
                woken = await self._wake_parked(state, session, work)
                if isinstance(woken, list):
                    return woken
                state = woken
        profile = self.profile(request.agent)
        ex = turn_of(state) if state.execution else None
        wait = ex.wait if ex is not None else None
        waited = wait.call_ids if wait is not None and wait.kind == "approval" else ()
        stepping = self.loop_factory(session, profile, redone).step(state, profile)
        return _Stepping(stepping, request, waited, turn_of(state).trace, tuple(also))

    async def _runs(
        self, ex: ExecutionState | None, work: StepWork, opening: Opening | None
    ) -> bool:
        """Whether ``work``'s turn is the session's running one (its head, started or not)."""
        if ex is not None:
            return ex.turn_id == work.turn_id
        return await self._head(work, opening) == work.turn_id

    async def _head(self, work: StepWork, opening: Opening | None) -> str | None:
        """The session's queue head: read with the lease at a turn's first step, else asked."""
        return opening.head if opening else await self.store.head(work.session_id)

    async def fail_turn(self, work: StepWork, code: str, reason: str) -> list[Action]:
        """End the turn of a step that can never succeed (``finish_reason: error``) through the
        loop's one ending, so that its publisher hears of it and the session's next turn can
        run. A turn that never started is ended as it is (no step, no content)."""
        session = await self.store.take(work.session_id)
        if session is None:
            return [Busy()]
        try:
            state = session.take_state()
            ex = state.execution if state else None
            if ex is not None and ex.turn_id != work.turn_id:
                # another turn runs: this one ended (what followed its end goes out again,
                # its worker may have died before) or never ran
                return await self._already_done(work, None, True, state)
            request = ex.request if ex else await self.store.request(work.session_id, work.turn_id)
            if request is None:
                # ended already (this very call, before a failure sent the message back):
                # what follows the end goes out again, or nothing was ever accepted
                head = await self.store.head(work.session_id)
                return await self._already_done(work, head, True, state)
            # the agent may be gone from the profiles (that may be why the step fails)
            profile = self.profiles.get(request.agent) or AgentProfile(name=request.agent)
            if state is None or ex is None:
                state = new_execution(state, request, profile, self.clock())
                if self.tracing is not None:
                    state = self.tracing.begin(state)
            error = TurnError(code=code[:64], message=reason[:4000])
            loop = self.loop_factory(session, profile, False)
            content = ex.last_content if ex else None
            finished = await loop.end(state, profile, "error", content, error=error)
            await self._unlist(ex)
            return await self._finished(finished, request, session)
        finally:
            if not session.released:
                await self.store.release(session)

    async def _finished(
        self, finished: Finished, request: TurnRequest, session: StepSession
    ) -> list[Action]:
        """What follows a turn's end: the reply to its publisher, and the session's next turn."""
        if self.tracing is not None:
            self.tracing.ended(finished.trace, request, finished.result)
        replies = session.replies or ((request.reply_to,) if request.reply_to else ())
        actions = await answers(self.deliver, finished.result, replies)
        actions += to_parent(finished.result)
        actions += cancel_children(finished.orphans, request.turn_id, finished.result.finish_reason)
        if session.next_turn is not None:
            actions.append(first_step(request.session_id, session.next_turn))
        return actions + await self._give_slot(request.turn_id, request.parent)

    async def _already_done(
        self, work: StepWork, head: str | None, redone: bool, state: AgentState | None = None
    ) -> list[Action]:
        """A step message for a turn that is not running: a duplicate, or the redelivered last
        step of a finished turn whose effects (reply, events, next kick) may not have gone out;
        ``state``: the session's, held under its lease."""
        result = await self.store.result(work.session_id, work.turn_id)
        if result is None or work.step < max(result.steps - 1, 0) or not redone:
            return [Drop(f"stale step message {work.turn_id}#{work.step}", "stale_step")]
        replies = await self.store.reply_to(work.session_id, work.turn_id)
        await announce_ended_step(self.events, result, state)
        await self._emit_finished(result)
        actions = await answers(self.deliver, result, replies)
        actions += to_parent(result)
        if head is not None and head != work.turn_id:
            actions.append(first_step(work.session_id, head))
        actions += await self._give_slot(work.turn_id, result.parent)
        return [*actions, Drop("finished turn: effects repeated", "finished_turn")]


@dataclass(frozen=True, slots=True)
class _Stepping:
    """A step about to run: the loop's step (holding the state) and the turn's request."""

    stepping: Awaitable[StepOutcome]
    request: TurnRequest
    waited: tuple[str, ...] = ()
    """The calls the turn waited on, if it was parked."""
    trace: TurnTrace | None = None
    """The turn's span ids, when it is traced."""
    also: tuple[Action, ...] = ()
    """Sent whatever the step does: first steps of turns its tenant's slots went to."""
