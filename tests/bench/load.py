"""Closed-loop load against the floor or loopwire, and what one window of it cost.

``sessions`` turns are in flight at all times: each on a fresh session whose state already
holds the 40-message history; when a turn's reply arrives the driver starts the next one.
After a warm-up the driver measures a window: the model server counts the steps (one model
call per step, for both systems), ``/proc`` gives the CPU time of every worker process, and
the model server reports the time every step spent outside the model call.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from tests.bench.targets import LoopwireTarget, ModelServer, Shared, Target


@dataclass
class Window:
    """What one measured window of load cost."""

    target: str
    sessions: int
    workers: int
    seconds: float
    steps: int
    worker_cpu_s: float
    other_cpu_s: dict[str, float]
    gaps: dict[str, float]
    rss_idle: int = 0
    rss_peak: int = 0
    health: dict[str, int] = field(default_factory=dict)
    finals: int = 0
    """Of ``steps``, the model calls answered with text (a sub-agent's)."""
    worker_sys_cpu_s: float = 0.0
    """Of ``worker_cpu_s``, the kernel's (system calls: mostly socket reads and writes)."""
    worker_syscalls: int = 0
    """The workers' read and write system calls over the window (``/proc/<pid>/io``: what
    uvloop's sockets make; the standard loop's ``send``/``recv`` are not counted there, so the
    floor shows none)."""

    @property
    def cpu_ms_per_step(self) -> float:
        return 1000 * self.worker_cpu_s / self.steps if self.steps else float("nan")

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "sessions": self.sessions,
            "workers": self.workers,
            "seconds": round(self.seconds, 3),
            "steps": self.steps,
            "steps_per_s": round(self.steps_per_s, 1),
            "worker_cpu_s": round(self.worker_cpu_s, 3),
            "worker_cpu_ms_per_step": round(self.cpu_ms_per_step, 4),
            "worker_sys_cpu_ms_per_step": (
                round(1000 * self.worker_sys_cpu_s / self.steps, 4) if self.steps else None
            ),
            "worker_syscalls_per_step": (
                round(self.worker_syscalls / self.steps, 2) if self.steps else None
            ),
            "other_cpu_ms_per_step": {
                k: round(1000 * v / self.steps, 4) if self.steps else None
                for k, v in self.other_cpu_s.items()
            },
            "outside_model_s": self.gaps,
            "rss_idle_mb": round(self.rss_idle / 2**20, 1),
            "rss_peak_mb": round(self.rss_peak / 2**20, 1),
            "health": self.health,
        }


class Driver:
    """Keeps ``sessions`` turns in flight against one target and measures one window."""

    def __init__(self, shared: Shared, model: ModelServer, run_id: str) -> None:
        self.shared = shared
        self.model = model
        self.run_id = run_id
        self.reply_to = ""
        self.done = 0
        self.started = 0
        self.feeding = False
        self.target: Target | None = None
        self.idle = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.errors: list[str] = []
        self.open: set[str] = set()
        """Turns started by the current measurement and not finished: a reply for any other turn
        (a late one of an aborted run) is ignored."""
        self.sessions: list[str] = []
        """The sessions of the turns started by ``launch``."""

    async def start(self) -> None:
        assert self.shared.connection is not None
        channel = await self.shared.connection.channel()
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        self.reply_to = queue.name
        await queue.consume(self._on_reply, no_ack=True)

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        turn = message.correlation_id or ""
        if turn not in self.open:
            return
        self.open.discard(turn)
        self.done += 1
        if isinstance(self.target, LoopwireTarget):
            self.target.check(message.body)
        if self.feeding:
            self._launch()
        elif self.started == self.done:
            self.idle.set()

    def _launch(self, tag: str = "") -> None:
        assert self.target is not None
        self.started += 1
        n = self.started
        turn_id = f"b{self.run_id}-{tag}{self.target.name[0]}{n}-{uuid.uuid4().hex[:6]}"
        session_id = f"b{self.run_id}-{tag}{self.target.name[0]}s{n}-{uuid.uuid4().hex[:6]}"
        self.open.add(turn_id)
        if tag:
            self.sessions.append(session_id)
        task = asyncio.create_task(self.target.seed_and_publish(turn_id, session_id, self.reply_to))
        self.tasks.add(task)
        task.add_done_callback(self._launched)

    def _launched(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(repr(task.exception()))

    async def measure(
        self,
        target: Target,
        *,
        sessions: int,
        warmup_s: float,
        window_s: float,
        drain: bool = True,
        drain_s: float = 60.0,
        rss_baseline: int | None = None,
    ) -> Window:
        """Keep ``sessions`` turns in flight; measure a window after ``warmup_s``. Then wait for
        the turns in flight to finish (``drain``), or leave them: the caller aborts them."""
        self.target = target
        self.done = self.started = 0
        self.open.clear()
        self.idle.clear()
        self.feeding = True
        rss0 = sum(w.rss() for w in target.workers) if rss_baseline is None else rss_baseline
        for _ in range(sessions):
            self._launch()
        await asyncio.sleep(warmup_s)
        before = await self.model.stats(reset=True)
        others = [*target.helpers, self.model.proc]
        cpu0 = {p.name: p.cpu() for p in [*target.workers, *others]}
        kernel0 = [w.kernel() for w in target.workers]
        t0 = time.monotonic()
        peak = 0
        while time.monotonic() - t0 < window_s:
            await asyncio.sleep(min(0.5, window_s))
            peak = max(peak, sum(w.rss() for w in target.workers))
        elapsed = time.monotonic() - t0
        after = await self.model.stats()
        cpu1 = {p.name: p.cpu() for p in [*target.workers, *others]}
        kernel1 = [w.kernel() for w in target.workers]
        self.feeding = False
        window = Window(
            target=target.name,
            sessions=sessions,
            workers=len(target.workers),
            seconds=elapsed,
            steps=after["served"] - before["served"],
            finals=after.get("finals", 0) - before.get("finals", 0),
            worker_cpu_s=sum(cpu1[w.name] - cpu0[w.name] for w in target.workers),
            other_cpu_s={p.name: cpu1[p.name] - cpu0[p.name] for p in others},
            gaps=after["gaps"],
            rss_idle=rss0,
            rss_peak=peak,
            health=target.health(),
            worker_sys_cpu_s=sum(k1[0] - k0[0] for k0, k1 in zip(kernel0, kernel1, strict=True)),
            worker_syscalls=sum(k1[1] - k0[1] for k0, k1 in zip(kernel0, kernel1, strict=True)),
        )
        if drain:
            if self.started == self.done:
                self.idle.set()
            try:
                await asyncio.wait_for(self.idle.wait(), drain_s)
            except TimeoutError:
                self.errors.append(
                    f"{target.name}: {self.started - self.done} turns did not finish "
                    f"within {drain_s:g}s; worker log:\n"
                    + "\n".join(w.log(1500) for w in target.workers)
                )
        for task in list(self.tasks):
            await task
        if self.errors:
            errors, self.errors = self.errors, []
            raise RuntimeError("; ".join(errors[:3]))
        return window

    def launch(self, target: Target, *, sessions: int, tag: str) -> None:
        """Start ``sessions`` turns at once and no more (``finished`` waits for them); their
        turn and session ids begin ``b<run id>-<tag>``, their sessions are in ``sessions``."""
        self.target = target
        self.done = self.started = 0
        self.open.clear()
        self.idle.clear()
        self.feeding = False
        self.sessions = []
        for _ in range(sessions):
            self._launch(tag)

    async def finished(self, timeout_s: float) -> bool:
        """Whether every turn ``launch`` started finished within ``timeout_s``; raises if one
        could not be started."""
        try:
            await asyncio.wait_for(self.idle.wait(), timeout_s)
        except TimeoutError:
            return False
        finally:
            for task in list(self.tasks):
                await task
            if self.errors:
                errors, self.errors = self.errors, []
                raise RuntimeError("; ".join(errors[:3]))
        return True

    async def hold(
        self, target: Target, *, sessions: int, baseline: int, timeout_s: float
    ) -> dict[str, float]:
        """Start ``sessions`` turns against a model that answers only after a long delay, wait
        until (nearly) all of them wait for it, and read the workers' RSS: memory per turn in
        flight. The caller aborts the turns afterwards."""
        self.target = target
        self.done = self.started = 0
        self.open.clear()
        self.feeding = False
        if os.environ.get("LW_BENCH_TRACEMALLOC"):  # the census the one at the end is set against
            for w in target.workers:
                os.kill(w.pid, signal.SIGUSR1)
            await asyncio.sleep(30)
        for _ in range(sessions):
            self._launch()
        deadline = time.monotonic() + timeout_s
        waiting = 0
        while time.monotonic() < deadline:
            await asyncio.sleep(1)
            waiting = (await self.model.stats())["waiting"]
            if waiting >= 0.97 * sessions:
                break
        await asyncio.sleep(1)
        rss = max(sum(w.rss() for w in target.workers) for _ in range(3))
        if os.environ.get("LW_BENCH_TRACEMALLOC"):
            for w in target.workers:
                os.kill(w.pid, signal.SIGUSR1)
            await asyncio.sleep(60)  # the snapshot takes a while
        waiting = (await self.model.stats())["waiting"]
        for task in list(self.tasks):
            await task
        return {
            "turns_waiting": waiting,
            "rss_baseline_mb": baseline / 2**20,
            "rss_mb": rss / 2**20,
            "kb_per_turn": (rss - baseline) / max(1, waiting) / 1024,
        }

    async def forget(self, tag: str) -> None:
        """Delete the Redis keys of the turns ``launch`` started with ``tag``."""
        for prefix in ("lw:", "lw:toolcall:", "bench:floorp:", "bench:toolfloor:"):
            await self.shared.delete_matching(f"{prefix}{{b{self.run_id}-{tag}*")
        await self.shared.delete_matching(f"lw:turn:b{self.run_id}-{tag}*")

    async def cleanup(self) -> None:
        await self.shared.delete_matching(f"lw:{{b{self.run_id}-*")
        await self.shared.delete_matching(f"lw:toolcall:{{b{self.run_id}-*")
        await self.shared.delete_matching(f"bench:floor:{{b{self.run_id}-*")
        await self.shared.delete_matching(f"bench:floorp:{{b{self.run_id}-*")
        await self.shared.delete_matching(f"bench:toolfloor:{{b{self.run_id}-*")
        await self.shared.delete_matching(f"lw:turn:b{self.run_id}-*")  # a turn's session
