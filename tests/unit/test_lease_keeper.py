"""The lease keeper on a clock of its own: when each held lease is renewed, and when a step
hears of a cancel through its renewal."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from contracts.control import TurnCancel
from worker.session.leases import LeaseKeeper
from worker.session.port import Renewal, StepSession
from worker.testing.memory import MemorySession, MemoryStore

TTL_S = 3.0
THIRD = TTL_S / 3


@dataclass
class Timer:
    at: float
    callback: Callable[[], object]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    def when(self) -> float:
        return self.at


@dataclass
class Clock:
    """Time that moves only when the test moves it; timers fire in order as it passes them."""

    now: float = 0.0
    timers: list[Timer] = field(default_factory=list)

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], object], /) -> Timer:
        timer = Timer(when, callback)
        self.timers.append(timer)
        return timer

    async def advance(self, to: float, keeper: LeaseKeeper) -> None:
        while due := sorted(
            (t for t in self.timers if not t.cancelled and t.at <= to), key=lambda t: t.at
        ):
            timer = due[0]
            self.timers.remove(timer)
            self.now = max(self.now, timer.at)
            timer.callback()
            await asyncio.gather(*keeper.renewals)  # the renewals it sent have answered
        self.now = to


class Recording(MemoryStore):
    """Records when each lease is renewed, by the test's clock."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(lease_ttl_s=TTL_S, clock=clock.time)
        self.renewed: dict[str, list[float]] = {}
        self.failing = 0

    async def renew(self, session: StepSession) -> Renewal:
        self.renewed.setdefault(session.session_id, []).append(self.clock())
        if self.failing:
            self.failing -= 1
            raise ConnectionError("Redis is away")
        return await super().renew(session)


async def take(store: MemoryStore, session_id: str) -> MemorySession:
    handle = await store.take(session_id, "t1")
    assert handle is not None
    return handle


def gaps(held_at: float, renewals: list[float]) -> list[float]:
    times = [held_at, *renewals]
    return [later - earlier for earlier, later in itertools.pairwise(times)]


async def test_every_held_lease_is_renewed_a_third_of_its_ttl_after_it_was_taken() -> None:
    clock = Clock()
    store = Recording(clock)
    keeper = LeaseKeeper(store, timers=clock)
    keeper.hold(await take(store, "first"))
    await clock.advance(0.4, keeper)  # a step that begins between two renewals of another
    keeper.hold(await take(store, "second"))
    await clock.advance(6.0, keeper)

    for session, held_at in (("first", 0.0), ("second", 0.4)):
        renewals = store.renewed[session]
        assert len(renewals) == 6 - (session == "second")
        assert max(gaps(held_at, renewals)) <= THIRD + 1e-9, (session, renewals)


async def test_a_step_hears_of_a_cancel_at_its_first_renewal() -> None:
    clock = Clock()
    store = Recording(clock)
    keeper = LeaseKeeper(store, timers=clock)
    keeper.hold(await take(store, "first"))
    await clock.advance(0.4, keeper)
    told: list[float] = []
    keeper.hold(await take(store, "second"), "t1#0", lambda: told.append(clock.now))
    await clock.advance(0.5, keeper)
    store.controls[("second", "t1")] = {"cancel": TurnCancel(turn_id="t1", reason="user left")}
    await clock.advance(3.0, keeper)

    assert told == [0.4 + THIRD]


async def test_a_renewal_that_fails_is_tried_again_a_sixth_of_the_ttl_later() -> None:
    clock = Clock()
    store = Recording(clock)
    keeper = LeaseKeeper(store, timers=clock)
    handle = await take(store, "first")
    keeper.hold(handle)
    store.failing = 1
    await clock.advance(2.0, keeper)

    assert store.renewed["first"] == [THIRD, THIRD * 1.5]
    assert await store.take("first") is None  # held still
    keeper.drop(handle)
