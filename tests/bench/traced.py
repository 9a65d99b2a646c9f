"""Run a module under tracemalloc; on SIGUSR1 write where its live memory was allocated.

``LW_BENCH_TRACEMALLOC=DIR python -m tests.bench --scenario concurrency`` runs the workers so
and signals them while all turns wait for the model: ``DIR/<name>-<pid>.txt`` then lists the
allocation sites holding the most memory (a tool for finding what a turn in flight keeps).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback
import tracemalloc
from pathlib import Path
from types import FrameType


def main() -> None:
    out, module, *rest = sys.argv[1:]
    tracemalloc.start(int(os.environ.get("LW_BENCH_TRACEMALLOC_FRAMES", "12")))

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

    signal.signal(signal.SIGUSR1, dump)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
