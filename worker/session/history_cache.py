"""A worker's copy of the long histories it works on, so that a step late in a long turn reads
and encodes only what the turn appended since the worker's last step of it.

Every model call sends the whole conversation, and without this every step read it from Redis
with its lease, decoded it and encoded it to JSON again: with 16 KB tool results, about
800 KB at step 50 of a turn. The worker keeps, per session, the history's items it has read
and written (decoded), each message's request JSON once encoded (``Encoded``), and the
history's *generation* (the state's field ``h``, ``worker.session.scripts``). The lease script
is given the generation and the number of items held, and hands back only the items after
them when the generation is still the history's; anything else (another generation, a list
shorter than the copy) gets the whole history, as before. The generation changes whenever the
history may have changed other than by appending: a cut (a cancel with rollback), a new
state (a session erased or expired and started again), a save by a worker of an earlier
release (which does not vouch for it). So a copy is either the history's exact start or not
used; what other workers appended in between comes with the lease.

A copy is kept only for a history of at least ``min_bytes`` stored (below that, reading it
costs less than holding it), and the copies of one worker are bounded by ``max_bytes``
(an estimate: three times the stored bytes, for the decoded messages and their JSON), the
least recently used going first; a copy unused for five minutes goes too, and the worker that
erases a session drops its copy at once (another worker's copy of an erased session is never
used: its generation is gone). A worker that did not run a session's last step reads only
what it has not seen; a worker that never ran it reads it whole. A save that fails or whose
outcome is unknown drops the session's copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from contracts.history import unpack
from worker.loop.transcript import Encoded, StoredMessages

HELD_PER_STORED_BYTE = 3
"""What a copy holds per stored byte, about: the decoded messages and their request JSON."""

IDLE_S = 300.0
"""A copy not used for this long goes."""


class Copy:
    """One session's history as far as the worker has it: the list's first ``items`` items,
    decoded, under ``generation``."""

    __slots__ = ("encoded", "generation", "items", "raw", "size", "used")

    def __init__(self, generation: str, items: int, raw: list[dict[str, Any]], size: int) -> None:
        self.used = 0.0
        self.generation = generation
        self.items = items
        self.raw = raw
        self.encoded: list[orjson.Fragment | None] = [None] * len(raw)
        self.size = size

    def add(self, raw: list[dict[str, Any]], items: int, size: int) -> None:
        self.raw.extend(raw)
        self.encoded.extend([None] * len(raw))
        self.items += items
        self.size += size


class HistoryCache:
    """The copies of one worker, least recently used first; a copy not used for ``idle_s``
    goes (so that what an erased or idle session said does not stay in a worker's memory)."""

    def __init__(
        self,
        max_bytes: int,
        min_bytes: int,
        *,
        idle_s: float = IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self.idle_s = idle_s
        self.clock = clock
        self._copies: dict[str, Copy] = {}
        self.held = 0
        """The estimated bytes held (``HELD_PER_STORED_BYTE`` per stored byte)."""

    def __len__(self) -> int:
        return len(self._copies)

    def get(self, session_id: str) -> Copy | None:
        self._evict()
        copy = self._copies.pop(session_id, None)
        if copy is not None:
            copy.used = self.clock()
            self._copies[session_id] = copy
        return copy

    def holds(self, session_id: str, copy: Copy) -> bool:
        return self._copies.get(session_id) is copy

    def put(self, session_id: str, copy: Copy) -> Copy | None:
        """Keep ``copy`` (``None``: it is too small or too large to keep)."""
        self.drop(session_id)
        if copy.size < self.min_bytes or copy.size * HELD_PER_STORED_BYTE > self.max_bytes:
            return None
        copy.used = self.clock()
        self._copies[session_id] = copy
        self.held += copy.size * HELD_PER_STORED_BYTE
        self._evict()
        return copy

    def grew(self, copy: Copy, raw: list[dict[str, Any]], items: int, size: int) -> None:
        copy.add(raw, items, size)
        self.held += size * HELD_PER_STORED_BYTE
        self._evict()

    def drop(self, session_id: str) -> None:
        copy = self._copies.pop(session_id, None)
        if copy is not None:
            self.held -= copy.size * HELD_PER_STORED_BYTE

    def _evict(self) -> None:
        """The least recently used copies go while the copies hold too much, or are idle."""
        idle = self.clock() - self.idle_s
        while self._copies:
            session_id, oldest = next(iter(self._copies.items()))
            if self.held <= self.max_bytes and oldest.used > idle:
                return
            self.drop(session_id)


class HistoryRead:
    """The history as one lease has it: the list's items from ``start`` on as read (``tail``),
    after the first ``start`` items, which the worker's copy holds, kept current with what the
    step's saves append (no other writer appends while the lease is held). ``messages`` is
    ``None`` when it cannot give the whole history (the copy moved on meanwhile under another
    lease of this worker, or a save cut the history): the caller reads it whole."""

    __slots__ = ("cache", "copy", "generation", "items", "session_id", "start", "tail", "whole")

    def __init__(
        self,
        cache: HistoryCache | None,
        session_id: str,
        copy: Copy | None,
        generation: str,
        start: int,
        items: int,
        tail: bytes,
    ) -> None:
        self.cache = cache
        self.session_id = session_id
        if copy is not None and not start and cache is not None:
            cache.drop(session_id)  # it no longer holds: the history was read whole
        self.copy = copy if start else None
        self.generation = generation
        self.start = start
        self.items = items
        self.tail: list[bytes] | None = [tail]
        self.whole = True

    def messages(self) -> StoredMessages | None:
        """The whole history: from the copy brought up to date, or read whole (then kept as a
        copy when it is long enough; else nothing of it stays here)."""
        if not self.whole:
            return None
        if self.copy is None and self.tail is not None:
            tail, self.tail = self.tail, None
            raw = unpack(tail)
            if self.cache is None or not self.generation:
                return StoredMessages(raw)
            made = Copy(self.generation, self.items, raw, sum(len(chunk) for chunk in tail))
            self.copy = self.cache.put(self.session_id, made)
            if self.copy is None:
                return StoredMessages(list(raw))
            self.start = self.items
        copy = self._synced()
        if copy is None:
            return None
        return StoredMessages(list(copy.raw), Encoded(copy.encoded, 0, len(copy.raw)))

    def saved(self, generation: str, appended: Sequence[bytes], *, cut: bool = False) -> None:
        """A save of the step succeeded: it appended ``appended`` (stored items) to the
        history, or cut it back (``cut``), and left it at ``generation``."""
        if cut:
            self.lost()
            return
        copy = self._synced() if self.copy is not None else None
        if not self.whole:
            return
        if copy is None:  # no copy: what was read (if not handed out yet) and these are the list
            if self.tail is not None:
                self.tail.extend(appended)
        else:  # the copy is the whole list now, whatever generation the save left it at
            copy.generation = generation
            if appended:
                size = sum(len(item) for item in appended)
                self._grow(copy, unpack(appended), len(appended), size)
        self.items += len(appended)
        self.generation = generation

    def lost(self) -> None:
        """A save failed, its outcome is unknown, or it cut the history: the lease's view and
        the copy are no longer known to hold."""
        copy = self.copy
        if self.cache is not None and copy is not None and self.cache.holds(self.session_id, copy):
            self.cache.drop(self.session_id)
        self.copy = None
        self.tail = None
        self.whole = False

    def _synced(self) -> Copy | None:
        """The copy holding the list's first ``items`` items, grown from the items read (once);
        ``None`` when it no longer starts where the items read go on."""
        copy = self.copy
        if copy is None:
            return None
        if self.tail is not None:
            tail, self.tail = self.tail, None
            if copy.items != self.start or copy.generation != self.generation:
                self.lost()  # another lease of this worker moved it on meanwhile
                return None
            if self.items > self.start:
                size = sum(len(chunk) for chunk in tail)
                self._grow(copy, unpack(tail), self.items - self.start, size)
        if copy.items != self.items:
            self.lost()
            return None
        return copy

    def _grow(self, copy: Copy, raw: list[dict[str, Any]], items: int, size: int) -> None:
        if self.cache is not None and self.cache.holds(self.session_id, copy):
            self.cache.grew(copy, raw, items, size)
        else:
            copy.add(raw, items, size)
