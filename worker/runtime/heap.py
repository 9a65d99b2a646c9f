"""Gives the C heap's free pages back to the OS while the worker runs.

Every step allocates and frees large blocks — the decoded history, the request body, the
answer, AMQP frames — through the C allocator (pymalloc keeps only objects up to 512 bytes).
glibc keeps freed blocks in its heap, and with thousands of turns in flight the holes between
the blocks still alive stay resident: without trimming a worker holds markedly more memory per
turn in flight than with the heap trimmed every second, for the same live objects.
``HeapTrimmer`` calls glibc's ``malloc_trim(0)`` — which returns every free page, not only the
heap's top — every ``heap_trim_s`` seconds while there is work (steps in flight, or messages
taken since the last tick) and once more after it, in a thread: the call walks the whole heap
holding glibc's arena locks, so only an allocation of a large block waits for it (Python's
small objects live in pymalloc's own arenas). An idle worker's heap is
left alone. C libraries without the call (musl, macOS) get no trimmer.

With the trimmer on, glibc's own ways of giving memory back are turned off (``mallopt``): a
block of 32 MB or less comes from the heap, not from a mapping of its own, and a free at the
heap's top does not shrink it. glibc maps a block afresh whenever it is larger than the largest
it mapped and freed before, and every page of a fresh mapping costs a page fault when it is
first written: a request body that grows with every step of a long turn (the conversation is
sent whole) was mapped, faulted in and unmapped for every copy of it, every step. From the heap
the blocks are reused, and the trimmer returns what is free once a tick.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import sys
import time
from collections.abc import Callable

log = logging.getLogger("loopwire.heap")

Trim = Callable[[], object]


M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
LARGEST_HEAP_BLOCK = 32 << 20
"""The largest block taken from the heap (glibc's upper bound for ``M_MMAP_THRESHOLD``)."""


def malloc_trim() -> Trim | None:
    """glibc's ``malloc_trim(0)``, or ``None`` where the C library has none; glibc's own
    returns of memory are turned off meanwhile (the module's docstring)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        function, mallopt = libc.malloc_trim, libc.mallopt
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not (
        mallopt(M_MMAP_THRESHOLD, LARGEST_HEAP_BLOCK)
        and mallopt(M_TRIM_THRESHOLD, 2 * LARGEST_HEAP_BLOCK)
    ):
        log.warning("could not keep large blocks in the heap (mallopt refused)")
    return lambda: function(0)


class HeapTrimmer:
    """Trims every ``every_s`` seconds while ``in_flight()`` (steps in hand) is not zero or
    ``handled()`` (messages taken) moved, and at the tick after that."""

    def __init__(
        self,
        trim: Trim,
        every_s: float,
        *,
        handled: Callable[[], int],
        in_flight: Callable[[], int],
    ) -> None:
        self.trim = trim
        self.every_s = every_s
        self.handled = handled
        self.in_flight = in_flight
        self.trims = 0

    async def run(self) -> None:
        seen, was_busy = None, True  # a first trim after start-up
        while True:
            await asyncio.sleep(self.every_s)
            handled = self.handled()
            busy = self.in_flight() > 0 or handled != seen
            seen = handled
            if busy or was_busy:  # the last steps' memory is freed after they left
                started = time.perf_counter()
                try:
                    await asyncio.to_thread(self.trim)
                except Exception:
                    log.exception("could not trim the heap")
                else:
                    self.trims += 1
                    log.debug("heap trimmed in %.1f ms", (time.perf_counter() - started) * 1000)
            was_busy = busy
