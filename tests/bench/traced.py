"""Run a module under tracemalloc; on SIGUSR1 write where its live memory was allocated.

``LW_BENCH_TRACEMALLOC=DIR python -m tests.bench --scenario concurrency`` runs the workers so
and signals them before the held turns start and again while all of them wait for the model:
``DIR/<name>-<pid>.txt`` then lists the allocation sites holding the most memory,
``DIR/<name>-<pid>.types.txt`` the live objects by type and ``….grown.txt`` what the turns added
between the two signals (tools for finding what a turn in flight keeps).
"""

from __future__ import annotations

import gc
import os
import runpy
import signal
import sys
import traceback
import tracemalloc
import types
from pathlib import Path
from types import FrameType


def main() -> None:
    out, module, *rest = sys.argv[1:]
    tracemalloc.start(int(os.environ.get("LW_BENCH_TRACEMALLOC_FRAMES", "12")))

    before: list[dict[str, tuple[int, int]]] = []

    def dump(_signum: int, _frame: FrameType | None) -> None:
        try:
            _dump()
        except BaseException:
            Path(f"{out}-{os.getpid()}.err").write_text(traceback.format_exc())
            raise

    def _dump() -> None:
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)]
        )
        lines = [f"total {sum(s.size for s in snapshot.statistics('filename')) / 1024:.0f} KiB"]
        groups: dict[str, list[int]] = {}
        stats = snapshot.statistics("traceback")
        for stat in stats:
            frames = [
                f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in stat.traceback
            ]
            ours = next(
                (f for f in reversed(frames) if "/work/" in f and "tests/bench" not in f), "-"
            )
            key = f"{frames[-1]}  <-  {ours}"
            entry = groups.setdefault(key, [0, 0])
            entry[0] += stat.size
            entry[1] += stat.count
        for key, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:60]:
            lines.append(f"{size / 1024:9.0f} KiB {count:7d}  {key}")
        for stat in stats[:30]:
            lines.append(f"\n{stat.size / 1024:.0f} KiB in {stat.count} blocks")
            lines.extend(f"    {line}" for line in stat.traceback.format(limit=12))
        Path(f"{out}-{os.getpid()}.txt").write_text("\n".join(lines))
        census = _census()
        Path(f"{out}-{os.getpid()}.types.txt").write_text("\n".join(_ranked(census)))
        if before:
            grown = {
                k: (v[0] - before[0].get(k, (0, 0))[0], v[1] - before[0].get(k, (0, 0))[1])
                for k, v in census.items()
            }
            Path(f"{out}-{os.getpid()}.grown.txt").write_text("\n".join(_ranked(grown, 150)))
        before[:] = [census]

    signal.signal(signal.SIGUSR1, dump)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _census() -> dict[str, tuple[int, int]]:
    """Live objects the collector tracks, by type: count and shallow size, what the worker froze
    at startup (``worker.runtime.collector``) included."""
    counts: dict[str, tuple[int, int]] = {}
    # get_objects does not list frozen objects; they stay with the others from here on (freezing
    # again would freeze the turns in flight too, and keep their garbage for good)
    gc.unfreeze()
    for obj in gc.get_objects():
        kind = type(obj)
        name = f"{kind.__module__}.{kind.__qualname__}{_detail(obj)}"
        count, size = counts.get(name, (0, 0))
        counts[name] = (count + 1, size + sys.getsizeof(obj, 0))
    return counts


def _detail(obj: object) -> str:
    """What tells containers and coroutines apart: a coroutine's function, the size of a set,
    the type of a list's first item, a dict's first key. Exact types only: ``isinstance`` would
    read ``__class__``, which makes the ``openai`` client's lazy proxies import their modules."""
    kind = type(obj)  # isinstance below only once the exact type matched
    if kind is types.CoroutineType and isinstance(obj, types.CoroutineType):
        return f" {obj.cr_code.co_qualname}"
    if kind is set and isinstance(obj, set):
        return f" len={len(obj)}"
    if kind is list and isinstance(obj, list):
        return f" of {type(obj[0]).__qualname__}" if obj else " empty"
    if kind is dict and isinstance(obj, dict):
        return f" [{next(iter(obj), '')!s:.40}]"
    return ""


def _ranked(counts: dict[str, tuple[int, int]], top: int = 80) -> list[str]:
    ranked = sorted(counts.items(), key=lambda kv: -kv[1][1])[:top]
    return [f"{size / 1024:9.1f} KiB {count:8d}  {name}" for name, (count, size) in ranked]


if __name__ == "__main__":
    main()
