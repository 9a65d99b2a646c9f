"""Where a worker's CPU goes: sort the samples of a ``py-spy`` recording into the parts of a step.

Record a worker while ``python -m tests.bench --scenario step`` runs (py-spy is not a project
dependency; ``pip install py-spy`` into your own environment)::

    py-spy record --pid <worker pid> --duration 15 --rate 250 --format raw -o worker.txt
    python -m tests.bench.attribute worker.txt --ms-per-step 8.7 [--floor]

Each sample goes to the first part whose frame appears in its stack; ``--ms-per-step`` (from the
same run's table) turns shares into milliseconds per step.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

Parts = tuple[tuple[str, tuple[str, ...]], ...]

LOOPWIRE: Parts = (
    ("model call (openai client + transport)", ("OpenAIModel.complete",)),
    ("tool RPC", ("ToolRPC.call", "ToolRPC._on_reply", "ToolRunner._call ")),
    (
        "events",
        (
            "Loop._emit ",
            "AmqpEventSink.emit",
            "CountingSink.emit",
            "_emit_accepted",
            "emit_invoked",
        ),
    ),
    ("Redis: lease (state + history read)", ("RedisStore.lease",)),
    ("Redis: saves (state encode + script)", ("SessionHandle.save",)),
    ("Redis: release", ("RedisStore.release",)),
    ("Redis: other", ("RedisStore.", "RegistryCatalog")),
    ("history decode", ("SessionHandle.load_messages",)),
    ("publish next step / reply, ack", ("Consumer._perform", "IncomingMessage.ack")),
    (
        "loop logic, state copies, work decode",
        ("worker/loop/", "worker/turns.py", "worker/consumer.py", "Worker.run.<locals>.on_message"),
    ),
    ("AMQP frame I/O tasks (aiormq)", ("aiormq/",)),
    ("HTTP and socket callbacks", ("aiohttp/", "selector_events.py")),
)
FLOOR: Parts = (
    ("model call (aiohttp POST + json)", tuple(f"floor.py:{n})" for n in range(130, 138))),
    ("tool RPC", ("RawRpc", "floor.py:139)")),
    ("event", ("floor.py:161)",)),
    ("publish next step / reply, ack", ("floor.py:170)", "floor.py:178)", "floor.py:184)")),
    ("Redis: load", ("floor.py:122)",)),
    ("Redis: save", ("floor.py:158)",)),
    ("step logic, msgpack", ("FloorWorker.on_step",)),
    ("AMQP frame I/O tasks (aiormq)", ("aiormq/",)),
    ("HTTP and socket callbacks", ("aiohttp/", "selector_events.py")),
)
"""Line numbers of ``tests/bench/floor.py``'s ``on_step``: keep them in step with that file."""


def attribute(path: Path, parts: Parts) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, _, n = line.rpartition(" ")
        if "concurrent/futures/thread.py" in stack:
            continue  # an idle executor thread waiting for work
        name = next(
            (name for name, keys in parts if any(k in stack for k in keys)),
            "other (event loop, timers, GC)",
        )
        counts[name] += int(n)
    return dict(counts)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.attribute")
    parser.add_argument("recording", type=Path, help="py-spy record --format raw output")
    parser.add_argument("--ms-per-step", type=float, help="worker CPU per step of the same run")
    parser.add_argument("--floor", action="store_true", help="the recording is of the floor")
    args = parser.parse_args()
    counts = attribute(args.recording, FLOOR if args.floor else LOOPWIRE)
    total = sum(counts.values()) or 1
    for name, n in sorted(counts.items(), key=lambda item: -item[1]):
        ms = f"  {args.ms_per_step * n / total:5.2f} ms/step" if args.ms_per_step else ""
        print(f"{100 * n / total:5.1f}%{ms}  {name}")


if __name__ == "__main__":
    main()
