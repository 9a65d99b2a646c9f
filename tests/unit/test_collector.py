"""The worker's garbage-collector settings (run in a child process: they are process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import gc, json, sys, weakref
from worker.runtime.collector import tune

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

gc.disable()  # nothing collects before tune does
startup_garbage = cycle()
kept = Node()
gc.enable()
tune(int(sys.argv[1]))
later_garbage = cycle()
gc.collect()
print(json.dumps({
    "threshold": gc.get_threshold(),
    "frozen": gc.get_freeze_count(),
    "startup_garbage_freed": startup_garbage() is None,
    "kept_is_frozen": not any(o is kept for o in gc.get_objects()),
    "later_garbage_freed": later_garbage() is None,
}))
"""


def _probe(young: int) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(young)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result: dict[str, object] = json.loads(out)
    return result


def test_tune_freezes_what_startup_built_and_collects_the_young_generation_less_often() -> None:
    default = _probe(0)
    tuned = _probe(10_000)
    assert tuned["threshold"] == [10_000, *default["threshold"][1:]]  # type: ignore[index]
    assert tuned["frozen"] and tuned["kept_is_frozen"], "what startup built is left alone"
    assert tuned["startup_garbage_freed"], "startup's garbage is collected, not frozen"
    assert tuned["later_garbage_freed"], "garbage made afterwards is still collected"


def test_zero_keeps_pythons_defaults() -> None:
    default = _probe(0)
    assert default["threshold"][0] == 700 and default["frozen"] == 0  # type: ignore[index]
    assert not default["kept_is_frozen"]
