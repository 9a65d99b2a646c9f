"""Keeps the session leases of the steps in progress: one timer for the whole worker.

A step takes its session's lease (TTL ``lease_ttl_s``) and must keep it while it runs, however
long the model thinks. Most steps end long before a renewal is due, so a timer per step would
be set and cancelled for nothing (and held, with its handle and context, by every turn in
flight). Here a step registers its ``StepSession`` (``hold``) and drops it when done; one
timer ticks every sixth of the TTL while any is held and renews, concurrently, each lease held
for a third of its TTL or more since it was taken or last renewed — so no lease goes longer than
half its TTL without a renewal. The renewal also says whether the step's turn was cancelled
meanwhile (``turn.cancel``): the step is then told at once, however long its model or tool
call still runs, at no extra round trip. A renewal that fails (Redis briefly away) is tried again at the
next tick (a renewal still in flight is not sent again); a lease found lost is logged and no
longer renewed (the step's next save fails with
``StaleStateError``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from worker.session.port import SessionStore, StepSession

log = logging.getLogger("loopwire.leases")


class LeaseKeeper:
    __slots__ = (
        "_renewals",
        "_timer",
        "held",
        "interval",
        "lost",
        "on_cancel",
        "renewing",
        "steps",
        "store",
    )

    def __init__(self, store: SessionStore, *, lost: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self.lost = lost
        self.on_cancel: dict[StepSession, Callable[[], None]] = {}
        """Called (once) when a renewal finds the step's turn cancelled."""
        """Called when a lease is found lost (the worker counts it)."""
        self.steps: dict[StepSession, str] = {}
        """What each held lease is for (``<turn_id>#<step>``), for the log when it is lost."""
        self.interval = store.lease_ttl_s / 3
        """A lease held this long (a third of its TTL, in seconds) is due for renewal."""
        self.held: dict[StepSession, float] = {}
        """Every handle held, with the loop time its lease was taken or last renewed."""
        self.renewing: set[StepSession] = set()
        """Handles with a renewal in flight (Redis slow): not sent again on top of it."""
        self._timer: asyncio.TimerHandle | None = None
        self._renewals: set[asyncio.Task[None]] = set()

    def hold(
        self, handle: StepSession, step: str = "", cancelled: Callable[[], None] | None = None
    ) -> None:
        """Keep ``handle``'s lease; ``cancelled`` is called when a renewal finds its turn
        cancelled (the step abandons what it waits for)."""
        loop = asyncio.get_running_loop()
        self.held[handle] = loop.time()
        self.steps[handle] = step
        if cancelled is not None:
            self.on_cancel[handle] = cancelled
        if self._timer is None:
            self._timer = loop.call_later(self.interval / 2, self._tick)

    def drop(self, handle: StepSession) -> None:
        self.held.pop(handle, None)
        self.steps.pop(handle, None)
        self.on_cancel.pop(handle, None)

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = [
            h
            for h, since in self.held.items()
            if now - since >= self.interval and h not in self.renewing
        ]
        self.renewing.update(due)
        if due:
            task = loop.create_task(self._renew(due))
            self._renewals.add(task)
            task.add_done_callback(self._renewals.discard)
        self._timer = loop.call_later(self.interval / 2, self._tick) if self.held else None

    async def _renew(self, due: list[StepSession]) -> None:
        await asyncio.gather(*(self._renew_one(handle) for handle in due))

    async def _renew_one(self, handle: StepSession) -> None:
        try:
            renewed = await self.store.renew(handle)
        except Exception as exc:
            log.warning("could not renew the lease of session %s: %s", handle.session_id, exc)
            return  # tried again at the next tick
        finally:
            self.renewing.discard(handle)
        if handle not in self.held or handle.released:
            return  # the step ended meanwhile
        if renewed != "lost":
            self.held[handle] = asyncio.get_running_loop().time()
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
