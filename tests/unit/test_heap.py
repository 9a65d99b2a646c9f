"""The heap trimmer: glibc gives freed heap pages back, and the worker trims only after work."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from pathlib import Path

import pytest

from worker.runtime.heap import HeapTrimmer, malloc_trim


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def test_malloc_trim_gives_freed_heap_pages_back() -> None:
    trim = malloc_trim()
    if trim is None:
        pytest.skip("this C library has no malloc_trim")
    trim()
    # Blocks of 20-40 KB (the C heap, below glibc's mmap threshold) freed between small blocks
    # that stay: the heap cannot shrink from its top, only by returning the pages in between.
    kept, freed = [], []
    for i in range(3000):
        freed.append(bytes(20_000 + (i % 20) * 1000))
        kept.append(bytes(600))
    del freed
    gc.collect()
    before = rss_mb()
    trim()
    after = rss_mb()
    assert before - after > 40, f"RSS {before:.0f} MB -> {after:.0f} MB"
    assert len(kept) == 3000


async def test_the_trimmer_trims_while_there_is_work_and_once_after() -> None:
    trims: list[tuple[int, int]] = []
    handled, in_flight = [0], [0]
    trimmer = HeapTrimmer(
        lambda: trims.append((handled[0], in_flight[0])),
        0.02,
        handled=lambda: handled[0],
        in_flight=lambda: in_flight[0],
    )
    task = asyncio.create_task(trimmer.run())
    try:
        await asyncio.sleep(0.2)
        assert trims == [(0, 0), (0, 0)], "after start-up, an idle worker's heap is left alone"
        handled[0], in_flight[0] = 5, 5  # steps taken, waiting for the model
        await asyncio.sleep(0.2)
        assert len(trims) >= 6 and set(trims[2:]) == {(5, 5)}, "trimmed while steps are in hand"
        in_flight[0] = 0
        await asyncio.sleep(0.2)
        after = trims[trims.index((5, 0)) :]
        assert after == [(5, 0)], "once after the last step, then left alone"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
