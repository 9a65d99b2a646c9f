"""Keeps the session leases of the steps in progress: one timer for the whole worker.

A step takes its session's lease (TTL ``lease_ttl_s``) and must keep it while it runs, however
long the model thinks. Most steps end long before a renewal is due, so a timer per step would
be set and cancelled for nothing (and held, with its handle and context, by every turn in
flight). Here a step registers its ``StepSession`` (``hold``) and drops it when done; one
timer, set for the earliest renewal due, renews, concurrently, each lease held for a third of
its TTL since it was taken or its last renewal was sent — so every held lease is renewed at
most a third of its TTL after that (5 s with the default 15 s TTL). The renewal also says
whether the step's turn was cancelled meanwhile (``turn.cancel``): the step is then told at
once, however long its model or tool call still runs, at no extra round trip. A renewal that
fails (Redis briefly away) is tried again a sixth of the TTL later (a renewal still in flight
is not sent again); a lease found lost is logged and no longer renewed (the step's next save
fails with ``StaleStateError``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from contracts import tenancy
from worker.session.port import Renewal, SessionStore, StepSession

log = logging.getLogger("loopwire.leases")

EARLY_S = 0.001
"""A timer that fires this little before a renewal's time still sends it."""


class Scheduled(Protocol):
    def cancel(self) -> None: ...

    def when(self) -> float: ...


class Timers(Protocol):
    """The clock and timer the keeper runs on: the running event loop unless one is given."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], object], /) -> Scheduled: ...


class LeaseKeeper:
    __slots__ = (
        "_given",
        "_timer",
        "held",
        "interval",
        "lost",
        "on_cancel",
        "renewals",
        "renewing",
        "steps",
        "store",
        "tenants",
    )

    def __init__(
        self,
        store: SessionStore,
        *,
        lost: Callable[[], None] = lambda: None,
        timers: Timers | None = None,
    ) -> None:
        self.store = store
        self.lost = lost
        """Called when a lease is found lost (the worker counts it)."""
        self.on_cancel: dict[StepSession, Callable[[], None]] = {}
        """Called (once) when a renewal finds the step's turn cancelled."""
        self.steps: dict[StepSession, str] = {}
        """What each held lease is for (``<turn_id>#<step>``), for the log when it is lost."""
        self.tenants: dict[StepSession, str | None] = {}
        """The tenant of each held session (``contracts.tenancy``): its keys are the tenant's."""
        self.interval = store.lease_ttl_s / 3
        """A lease is renewed this long (a third of its TTL, in seconds) after it was taken or
        its last renewal was sent."""
        self.held: dict[StepSession, float] = {}
        """Every handle held, with the time its next renewal is due."""
        self.renewing: set[StepSession] = set()
        """Handles with a renewal in flight (Redis slow): not sent again on top of it."""
        self._given = timers
        self._timer: Scheduled | None = None
        self.renewals: set[asyncio.Task[None]] = set()
        """The rounds of renewals in flight."""

    def _timers(self) -> Timers:
        return self._given if self._given is not None else asyncio.get_running_loop()

    def hold(
        self, handle: StepSession, step: str = "", cancelled: Callable[[], None] | None = None
    ) -> None:
        """Keep ``handle``'s lease (taken just now); ``cancelled`` is called when a renewal finds
        its turn cancelled (the step abandons what it waits for)."""
        self.steps[handle] = step
        self.tenants[handle] = tenancy.current()  # renewed from a task of the keeper's own
        if cancelled is not None:
            self.on_cancel[handle] = cancelled
        self._due(handle, self._timers().time() + self.interval)

    def drop(self, handle: StepSession) -> None:
        self.held.pop(handle, None)
        self.steps.pop(handle, None)
        self.tenants.pop(handle, None)
        self.on_cancel.pop(handle, None)

    def _tick(self) -> None:
        self._timer = None
        now = self._timers().time()
        due = [h for h, at in self.held.items() if at <= now + EARLY_S and h not in self.renewing]
        if due:
            self.renewing.update(due)
            task = asyncio.get_running_loop().create_task(self._renew(due, now))
            self.renewals.add(task)
            task.add_done_callback(self.renewals.discard)
        self._schedule()

    def _schedule(self) -> None:
        """Set the timer for the earliest renewal due (of the leases with none in flight)."""
        waiting = [at for h, at in self.held.items() if h not in self.renewing]
        if waiting:
            self._timer_by(min(waiting))

    def _due(self, handle: StepSession, at: float) -> None:
        """``handle``'s next renewal is due ``at``."""
        self.held[handle] = at
        self._timer_by(at)

    def _timer_by(self, at: float) -> None:
        """The timer fires at ``at`` or before (it is set for the earliest renewal due)."""
        if self._timer is not None:
            if self._timer.when() <= at:
                return
            self._timer.cancel()
        self._timer = self._timers().call_at(at, self._tick)

    async def _renew(self, due: list[StepSession], sent: float) -> None:
        await asyncio.gather(*(self._renew_one(handle, sent) for handle in due))

    async def _renew_one(self, handle: StepSession, sent: float) -> None:
        try:
            try:
                with tenancy.acting_for(self.tenants.get(handle)):  # the session's keys
                    renewed: Renewal | None = await self.store.renew(handle)
            except Exception as exc:
                log.warning("could not renew the lease of session %s: %s", handle.session_id, exc)
                renewed = None
            if handle in self.held and not handle.released:  # else the step ended meanwhile
                self._renewed(handle, renewed, sent)
        finally:
            self.renewing.discard(handle)

    def _renewed(self, handle: StepSession, renewed: Renewal | None, sent: float) -> None:
        if renewed is None:  # tried again soon
            self._due(handle, self._timers().time() + self.interval / 2)
        elif renewed != "lost":
            self._due(handle, sent + self.interval)
            if renewed == "cancelled" and (cancelled := self.on_cancel.pop(handle, None)):
                log.info("turn of %s was cancelled while it ran", self.steps.get(handle))
                cancelled()
        else:
            step = self.steps.get(handle) or "a step"
            log.warning(
                "lost the lease of session %s while running %s: another worker may take it "
                "over; this worker's next save of it fails and the step is redone",
                handle.session_id,
                step,
            )
            self.held.pop(handle, None)
            self.lost()
