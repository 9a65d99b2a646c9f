"""Faults at the session store, for the sequencer's simulation: a worker that dies right after
one of its writes (a save point), and Redis failing one call.

``FaultyStore`` wraps a ``MemoryStore`` and every ``StepSession`` it hands out. Before a
delivery the simulation arms at most one fault: ``crash_after(n)`` lets the delivery's n-th
write happen and then kills the worker (``Crash``: every later store call of that delivery
raises too, so nothing a dead worker would not do happens — it does not even let go of its
lease); ``fail_call(n)`` makes the delivery's n-th store call raise ``RedisError`` without
doing anything, as a dropped connection would.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from worker.testing.memory import MemoryStore

WRITES = frozenset(
    {
        "accept",
        "take",
        "renew",
        "record_control",
        "end_queued",
        "release",
        "add_spent",
        "note_approvals",
        "note_children",
        "clear_approvals",
        "save",
        "list_waiting",
        "erase",
        "admit",
    }
)
"""The store and session calls that change what Redis holds: each one is a save point (with
the tenants' slots': ``admit`` and their ``release``)."""


class Crash(BaseException):
    """The worker died here: nothing of this delivery goes on."""


class Faults:
    """The fault armed for one delivery, and what happened to it."""

    def __init__(self) -> None:
        self.crash_after: int | None = None
        self.fail_call: int | None = None
        self.calls = 0
        self.writes = 0
        self.dead = False
        self.fired: str | None = None
        """Where the fault struck (``crash after save`` …), once it did."""

    def arm(self, *, crash_after: int | None = None, fail_call: int | None = None) -> None:
        self.crash_after, self.fail_call = crash_after, fail_call
        self.calls = self.writes = 0
        self.dead = False
        self.fired = None

    def before(self, name: str) -> None:
        if self.dead:
            raise Crash(name)
        self.calls += 1
        if self.fail_call is not None and self.calls == self.fail_call:
            self.fail_call = None
            self.fired = f"RedisError in {name}"
            raise RedisConnectionError(f"simulated: Redis dropped the connection in {name}")

    def after(self, name: str) -> None:
        if name not in WRITES:
            return
        self.writes += 1
        if self.crash_after is not None and self.writes == self.crash_after:
            self.crash_after = None
            self.dead = True
            self.fired = f"crash after {name}"
            raise Crash(name)


class _Faulty:
    """Calls through to ``inner``, with ``faults`` before and after each awaited call."""

    def __init__(self, inner: Any, faults: Faults) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_faults", faults)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name.startswith("_") or not callable(value):
            return value
        faults: Faults = self._faults

        def sync_or_async(*args: Any, **kwargs: Any) -> Any:
            result = value(*args, **kwargs)
            if not hasattr(result, "__await__"):
                return result

            async def awaited() -> Any:
                try:
                    faults.before(name)
                except BaseException:
                    result.close()  # never run: the call did not happen
                    raise
                out = await result
                faults.after(name)
                return self._wrap(name, out)

            return awaited()

        return sync_or_async

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def _wrap(self, name: str, out: Any) -> Any:
        return out


class FaultyStore(_Faulty):
    """A ``MemoryStore`` whose calls, and whose sessions' calls, can fail (``Faults``)."""

    def __init__(self, inner: MemoryStore, faults: Faults) -> None:
        super().__init__(inner, faults)

    def _wrap(self, name: str, out: Any) -> Any:
        if name == "take" and out is not None:
            return _Faulty(out, self._faults)
        return out


class FaultySlots(_Faulty):
    """A tenant's slots (``MemoryTenantSlots``) whose calls can fail as the store's do."""
