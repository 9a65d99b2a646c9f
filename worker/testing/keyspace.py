"""The expiry of the ``MemoryStore``'s entries, kept as Redis keeps its keys' TTLs.

Each entry of the memory store stands for one Redis key (named by ``contracts.keys``) and is
registered here under that name with the function that deletes it. The rules are Redis's:
a key written for the first time has no expiry; writing it again keeps the expiry it has;
``expire`` sets one; a key whose time has passed is gone (``sweep``, called at the start of
every store operation, deletes it as Redis would at its next access). So a test, or the
sequencer's simulation, moving the store's clock past a TTL sees what Redis would show.
"""

from __future__ import annotations

from collections.abc import Callable


class Keyspace:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.expires: dict[str, float | None] = {}
        """Every live key: when it expires (``None``: never)."""
        self._drops: dict[str, Callable[[], None]] = {}
        self.renewed: dict[str, float] = {}
        """When each key's expiry was last set or put off."""

    def written(self, key: str, drop: Callable[[], None]) -> None:
        """``key`` was written: it exists (its expiry, if it had one, is kept)."""
        self.expires.setdefault(key, None)
        self._drops[key] = drop

    def expire(self, key: str, ttl_s: float, drop: Callable[[], None] | None = None) -> None:
        """``EXPIRE key ttl_s`` (on a key that exists, or that ``drop`` deletes)."""
        if drop is not None:
            self._drops[key] = drop
        if key in self._drops:
            self.expires[key] = self.clock() + ttl_s
            self.renewed[key] = self.clock()

    def extend(self, key: str, ttl_s: float) -> None:
        """``EXPIRE key ttl_s NX`` then ``GT``: a key without expiry gets one, a sooner one is
        put off, a later one stays."""
        if key in self._drops:
            at, now = self.expires.get(key), self.clock() + ttl_s
            self.expires[key] = now if at is None else max(at, now)
            self.renewed[key] = self.clock()

    def deleted(self, key: str) -> None:
        """``key`` is gone (deleted, or emptied: Redis drops an empty hash or list)."""
        self.expires.pop(key, None)
        self._drops.pop(key, None)
        self.renewed.pop(key, None)

    def sweep(self) -> list[str]:
        """Delete every key whose time has passed; the names of those deleted."""
        now = self.clock()
        gone = [k for k, at in self.expires.items() if at is not None and at <= now]
        for key in gone:
            drop = self._drops.pop(key)
            del self.expires[key]
            self.renewed.pop(key, None)
            drop()
        return gone

    def without_expiry(self) -> list[str]:
        """The live keys that would never expire."""
        return sorted(k for k, at in self.expires.items() if at is None)
