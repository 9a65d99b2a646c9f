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


def malloc_trim() -> Trim | None:
    """glibc's ``malloc_trim(0)``, or ``None`` where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
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
