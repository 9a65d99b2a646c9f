"""A tenant's cap on running turns, at the edges of a turn (``worker.session.tenant_slots``):
mixed into ``SessionSequencer``. A turn's first step takes a slot of its tenant or puts the
turn in the tenant's line (it is dropped: the turn waits holding nothing); a turn's end gives
its slot back, and the first steps of the turns that slot goes to are sent. With tenancy off,
no cap, or a child turn (its parent holds a slot), these do nothing."""

from __future__ import annotations

from collections.abc import Callable

from contracts import tenancy
from contracts.turns import TurnRequest
from contracts.work import StepWork
from worker.loop.ports import LoopObserver
from worker.runtime import failpoints
from worker.sequencing.actions import Action, Drop, first_step
from worker.session.tenant_slots import TenantSlots


class Throttling:
    """Mixed into ``SessionSequencer``: what it has that these use."""

    slots: TenantSlots | None
    clock: Callable[[], float]
    observer: LoopObserver

    async def _take_slot(self, work: StepWork, request: TurnRequest) -> tuple[bool, list[Action]]:
        """Whether the turn's first step runs now, and the first steps to send."""
        tenant = tenancy.current()
        if self.slots is None or request.parent is not None or not self.slots.capped(tenant):
            return True, []
        assert tenant is not None
        runs, woken = await self.slots.admit(tenant, work.turn_id, work.session_id, self.clock())
        wakes: list[Action] = [first_step(session, turn) for turn, session in woken]
        if runs:
            return True, wakes
        self.observer.throttled(request.agent, "tenant")
        why = f"turn {work.turn_id} waits in line for a slot of tenant {tenant!r}"
        return False, [*wakes, Drop(why, "tenant_throttled")]

    async def _give_slot(self, turn_id: str, parent: object | None) -> list[Action]:
        """The turn ended (or its end is repeated): the first steps of the turns its slot
        goes to."""
        tenant = tenancy.current()
        if self.slots is None or parent is not None or not self.slots.capped(tenant):
            return []
        assert tenant is not None
        woken = await self.slots.release(tenant, turn_id, self.clock())
        if woken:
            failpoints.hit("tenant_slot_released")
        return [first_step(session, turn) for turn, session in woken]

    async def _wake_in_line(self, session_id: str, turn_id: str) -> list[Action]:
        """The first step of a turn waiting in its tenant's line (a cancel ends it there)."""
        tenant = tenancy.current()
        if self.slots is None or not self.slots.capped(tenant):
            return []
        assert tenant is not None
        return (
            [first_step(session_id, turn_id)] if await self.slots.in_line(tenant, turn_id) else []
        )
