"""Control messages and parked turns, the sequencer's half that steers a turn from outside:
``turn.cancel``, ``turn.decision`` and ``turn.child_result`` are recorded beside the turn
(once each: a copy is a no-op) and applied under the session's lease by the step they wake; a
parked turn's step merges what was recorded (decisions, child results) or, at its timeout,
what the timeout decides (for children: an error result for each child still out, which is
cancelled). A child turn that cannot run reports to its parent all the same: a rejected request
(``on_refused``) with an error, one accepted after its parent ended is cancelled at once.
``SessionSequencer`` (``worker.sequencing.sequencer``) mixes it in.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from contracts.control import TurnCancel, TurnChildResult, TurnDecision
from contracts.events import ChildFinished
from contracts.state import AgentState, ChildTurn, ExecutionState, StopSignal
from contracts.turns import TurnRequest, TurnResult
from contracts.work import StepWork
from worker.loop import EventSink, Finished, Loop, Waiting, new_execution
from worker.loop.announce import announce
from worker.loop.approvals import timed_out, with_decisions
from worker.loop.children import child_failed, given_up, late_children, with_child_results
from worker.loop.gates import announce_throttle
from worker.loop.ports import LoopObserver, observe
from worker.loop.turn import turn_of, turn_result, with_execution
from worker.profiles.agents import AgentProfile, ProfileLookup
from worker.runtime import failpoints
from worker.runtime.tracing import Tracing
from worker.sequencing.actions import (
    Action,
    Control,
    Delay,
    Drop,
    Start,
    Step,
    cancel_children,
    to_parent,
    wake,
)
from worker.sequencing.announcing import answers
from worker.session.port import SessionStore, StepSession

log = logging.getLogger("loopwire.sequencer")


class Controls:
    """Mixed into ``SessionSequencer``: what it has that these use."""

    store: SessionStore
    profiles: ProfileLookup
    loop_factory: Callable[[StepSession, AgentProfile, bool], Loop]
    events: EventSink
    clock: Callable[[], float]
    observer: LoopObserver
    tracing: Tracing | None
    deliver: Callable[[TurnResult], Awaitable[TurnResult]]

    def profile(self, agent: str) -> AgentProfile:
        raise NotImplementedError

    async def _finished(
        self, finished: Finished, request: TurnRequest, session: StepSession
    ) -> list[Action]:
        raise NotImplementedError

    async def _emit_finished(self, result: TurnResult) -> None:
        raise NotImplementedError

    async def _wake_in_line(self, session_id: str, turn_id: str) -> list[Action]:
        raise NotImplementedError

    async def on_decision(self, decision: TurnDecision) -> list[Action]:
        """Record a decision on a call a turn waits on; a parked turn's step is published, and
        applies every decision recorded so far under the lease."""
        turn_id = decision.turn_id
        session_id = decision.session_id or await self.store.session_of(turn_id)
        if session_id is None:
            return [Drop(f"decision for unknown turn {turn_id}", "unknown_turn")]
        field = f"decision:{decision.call_id}"
        recorded = await self.store.record_control(session_id, turn_id, field, decision)
        if recorded.status == "unknown":
            return [Drop(f"decision for unknown turn {turn_id}", "unknown_turn")]
        if recorded.status == "finished":
            return [Drop(f"decision for finished turn {turn_id}", "finished_turn")]
        failpoints.hit("decision_recorded")
        if recorded.status == "again" and recorded.parked is None:
            return [Drop(f"second decision on call {decision.call_id}", "duplicate")]
        return wake(session_id, turn_id, recorded.parked)

    async def on_cancel(self, cancel: TurnCancel) -> list[Action]:
        """Record a cancel and end the turn wherever it is: one queued behind others at once;
        the running one by its next step (or the step running now, told by its lease renewal),
        which sees the cancel under the lease."""
        turn_id = cancel.turn_id
        session_id = cancel.session_id or await self.store.session_of(turn_id)
        if session_id is None:
            return [Drop(f"cancel for unknown turn {turn_id}", "unknown_turn")]
        recorded = await self.store.record_control(session_id, turn_id, "cancel", cancel)
        if recorded.status == "unknown":
            return [Drop(f"cancel for unknown turn {turn_id}", "unknown_turn")]
        if recorded.status == "finished":
            return await self._cancelled_before(session_id, cancel)
        failpoints.hit("cancel_recorded")
        request = await self.store.request(session_id, turn_id)
        if request is None:  # ended meanwhile
            return [Drop(f"cancel for finished turn {turn_id}", "finished_turn")]
        profile = self.profiles.get(request.agent) or AgentProfile(name=request.agent)
        state = _cancelled(new_execution(None, request, profile, self.clock()), cancel)
        result = turn_result(state, "cancelled", None, None, self.clock())
        ended, replies = await self.store.end_queued(session_id, turn_id, result)
        if ended == "finished":
            return await self._cancelled_before(session_id, cancel)
        if ended == "ended":
            observe(self.observer.turn_finished, result)
            if self.tracing is not None:
                self.tracing.ended(None, request, result)
        if ended == "head":
            # the session's running turn: its next step message (or the renewal of the step
            # running now) finds the cancel under the lease; a parked one has none, so the
            # step it is parked at is published, and so is the first step of one that waits
            # in its tenant's line
            if recorded.parked is None:
                return await self._wake_in_line(session_id, turn_id)
            return wake(session_id, turn_id, recorded.parked)
        return await self._queued_end(result, replies)

    async def _queued_end(self, result: TurnResult, replies: Sequence[str]) -> list[Action]:
        """What follows a queued turn's end: its event, its replies, and a child's report to
        its parent (a child queued in a named session ends its parent's wait too)."""
        await self._emit_finished(result)
        return [*await answers(self.deliver, result, replies), *to_parent(result)]

    async def _cancelled_before(self, session_id: str, cancel: TurnCancel) -> list[Action]:
        """A cancel for a turn that has ended. If this cancel ended it (a copy of the one that
        did), the delivery that ended it may have died before its effects went out: they go out
        again (the same event, copies of the replies and of a child's report)."""
        turn_id = cancel.turn_id
        drop = Drop(f"cancel for finished turn {turn_id}", "finished_turn")
        result = await self.store.result(session_id, turn_id)
        if result is None or (result.finish_reason, result.stopped_by) != (
            "cancelled",
            cancel.reason,
        ):
            return [drop]
        replies = await self.store.reply_to(session_id, turn_id)
        return [*await self._queued_end(result, replies), drop]

    async def on_child_result(self, message: TurnChildResult) -> list[Action]:
        """Record a child turn's result for its parent; the parent's parked step is published,
        and merges every result recorded so far under the lease."""
        parent = message.parent
        field = f"child:{parent.call_id}"
        recorded = await self.store.record_control(
            parent.session_id, parent.turn_id, field, message
        )
        if recorded.status == "unknown":
            return [Drop(f"child result for unknown turn {parent.turn_id}", "unknown_turn")]
        if recorded.status == "finished":
            return [Drop(f"child result for finished turn {parent.turn_id}", "finished_turn")]
        failpoints.hit("child_result_recorded")
        if recorded.status == "again" and recorded.parked is None:
            return [Drop(f"second result for call {parent.call_id}", "duplicate")]
        return wake(parent.session_id, parent.turn_id, recorded.parked)

    async def _orphaned(self, request: TurnRequest) -> list[Action]:
        """A child turn just accepted whose parent has ended meanwhile (its cancel came before
        the child was known, and found nothing): it is cancelled now, before it runs."""
        parent = request.parent
        if parent is None:
            return []
        ended = await self.store.result(parent.session_id, parent.turn_id)
        if ended is None:
            return []
        cancel = TurnCancel(
            turn_id=request.turn_id,
            session_id=request.session_id,
            reason=f"parent {ended.finish_reason}",
            by=f"turn {parent.turn_id}",
        )
        return await self.on_cancel(cancel)

    def on_refused(self, request: TurnRequest, code: str, reason: str) -> list[Action]:
        """A turn request that is rejected (dead-lettered): a child's parent gets the error as
        its call's result, so that its wait ends (a copy of it is a no-op there)."""
        parent = request.parent
        if parent is None:
            return []
        child = ChildTurn(
            call_id=parent.call_id,
            turn_id=request.turn_id,
            session_id=request.session_id,
            agent=request.agent,
        )
        return [Control(child_failed(parent, child, code, f"not run: {reason}", self.clock()))]

    async def _wake_parked(
        self, state: AgentState, session: StepSession, work: StepWork
    ) -> AgentState | list[Action]:
        """A step message for a parked turn: the decisions recorded so far go into its state,
        and its own timeout message, when due, rejects what is still undecided."""
        ex = turn_of(state)
        wait = ex.wait
        assert wait is not None
        if wait.kind == "children":
            return await self._merge_children(state, session, work)
        if wait.kind == "throttled" and work.wait_until is None:
            # not its timeout: it waits for its slot (sent again, and announced again, in case
            # the worker that parked it died before it could send or announce it)
            await announce_throttle(self.events, state)
            return [Delay(work.model_copy(update={"wait_until": wait.until}))]
        woken = with_decisions(state, session.decisions)
        if work.wait_until is not None:
            if work.wait_until != wait.until:
                return [Drop(f"stale timeout of {work.turn_id}#{work.step}", "stale_step")]
            now = self.clock()
            # a wait never ends before its time (a Retry-After is a floor, an approval's
            # ``until`` was announced): back early, it waits the rest
            if now < work.wait_until:  # one hop of several: on to the next
                return [Delay(work)]
            deadline = ex.request.deadline
            if wait.kind != "approval" or (deadline is not None and now >= deadline):
                return woken  # the loop ends a turn past its deadline, as at any deadline
            return timed_out(woken, now)
        return woken

    async def _merge_children(
        self, state: AgentState, session: StepSession, work: StepWork
    ) -> AgentState | list[Action]:
        """A step message for a turn waiting on its children: the results recorded so far go
        into its state (``child.finished`` for each new one); its own timeout message (the
        turn's deadline) comes back until it is due."""
        ex = turn_of(state)
        wait = ex.wait
        assert wait is not None
        if work.wait_until is not None:
            if work.wait_until != wait.until:
                return [Drop(f"stale timeout of {work.turn_id}#{work.step}", "stale_step")]
            if self.clock() < work.wait_until:
                return [Delay(work)]
            late = late_children(state, session.children, self.clock())
            if late:
                return await self._give_up_on(late, work)
            out = given_up(state, session.children)
            if out:  # given up on before, by a delivery that may have died: the same again
                return self._stopped_waiting(out, work)
        # as they came: the loop passes them through the agent's after_tool hooks (and cuts them
        # to max_tool_result_chars) before the model sees them
        merged, fresh = with_child_results(state, session.children)
        index = ex.pending.index if ex.pending is not None else ex.step_count
        for child, result in fresh:
            await announce(
                self.events,
                result.completed_at,
                "child.finished",
                ChildFinished(
                    call_id=child.call_id,
                    turn_id=child.turn_id,
                    agent=child.agent,
                    finish_reason=result.finish_reason,
                    usage=result.usage,
                    cost_usd=result.cost_usd,
                    duration_s=result.duration_s,
                ),
                merged,
                step=index,
                call_id=child.call_id,
            )
        return merged

    async def _give_up_on(
        self, late: list[tuple[ChildTurn, TurnChildResult]], work: StepWork
    ) -> list[Action]:
        """The wait for children is over: each child still out gets its error result recorded
        as its answer (a copy, or its real answer coming later, is a no-op) and is cancelled;
        the parked step is published, and merges them as it merges any answer."""
        for child, failed in late:
            await self.store.record_control(
                work.session_id, work.turn_id, f"child:{child.call_id}", failed
            )
        return self._stopped_waiting([child for child, _ in late], work)

    def _stopped_waiting(self, children: list[ChildTurn], work: StepWork) -> list[Action]:
        """A cancel for each child given up on, and the parked step, which merges its error."""
        gone = cancel_children(children, work.turn_id, "stopped waiting")
        return [*gone, Step(work.model_copy(update={"wait_until": None}))]

    def _waiting(self, outcome: Waiting, work: StepWork, session: StepSession) -> list[Action]:
        """The turn is parked: its timeout message goes out (again, when a step message finds
        it still waiting: the worker that parked it may have died before sending it; copies
        are harmless), and control messages recorded while it parked wake it at once."""
        tracing = self.tracing
        actions: list[Action] = [
            Start(request if tracing is None else tracing.stamped(request))
            for request in outcome.start
        ]
        if outcome.until is not None:
            actions.append(Delay(work.model_copy(update={"wait_until": outcome.until})))
        if session.controls_waiting:
            actions.append(Step(work.model_copy(update={"wait_until": None})))
        return actions

    async def _end_cancelled(
        self, session: StepSession, state: AgentState | None, work: StepWork, cancel: TurnCancel
    ) -> list[Action]:
        """End the session's running turn for its cancel, with the content it had."""
        ex = state.execution if state else None
        request = ex.request if ex else await self.store.request(work.session_id, work.turn_id)
        if request is None:
            return [Drop(f"turn {work.turn_id} has no stored request", "missing_request")]
        profile = self.profiles.get(request.agent) or AgentProfile(name=request.agent)
        if state is None or ex is None:
            state = new_execution(state, request, profile, self.clock())
        loop = self.loop_factory(session, profile, False)
        content = ex.last_content if ex else None
        finished = await loop.end(
            _cancelled(state, cancel), profile, "cancelled", content, rollback=cancel.rollback
        )
        await self._unlist(ex)
        return await self._finished(finished, request, session)

    async def _unlist(self, ex: ExecutionState | None) -> None:
        """A turn ended while parked: its calls off the list of calls waiting for a decision."""
        if ex is not None and ex.wait is not None:
            await self.store.clear_approvals(ex.turn_id, ex.wait.call_ids)


def _cancelled(state: AgentState, cancel: TurnCancel) -> AgentState:
    """The turn marked as stopped by its cancel: ``stopped_by`` is the cancel's reason."""
    by = f"cancelled by {cancel.by}" if cancel.by else "cancelled"
    return with_execution(state, stop_signal=StopSignal(source=cancel.reason, reason=by))
