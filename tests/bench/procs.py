"""Processes of a benchmark run and what they cost: CPU time and RSS read from ``/proc``."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
_CHILD = Path(__file__).resolve().with_name("child.py")
"""Runs every child so that it stops when this process dies (``tests/bench/child.py``)."""
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (utime is ``[11]``, stime
    ``[12]``, in clock ticks)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a whole process (all its threads), in seconds."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / _TICK


def kernel_use(pid: int) -> tuple[float, int]:
    """System CPU seconds of a whole process, and the read and write system calls it made
    (``/proc/<pid>/io``): what its socket traffic costs the kernel."""
    calls = 0
    with open(f"/proc/{pid}/io", encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("syscr", "syscw"):
                calls += int(value)
    return int(_stat(pid)[12]) / _TICK, calls


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * _PAGE


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Proc:
    """A child process (``python -m <module>``, stopped if the benchmark dies) with its log in a
    temp file."""

    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> None:
        self.name = name
        self.args = args
        self.cwd = cwd
        self.env = {**os.environ, **(env or {})}
        self.traced = bool(os.environ.get("LW_BENCH_TRACEMALLOC")) and args[:2] == ["-m", "worker"]
        self.log_path = Path(tempfile.mkstemp(prefix=f"lw-bench-{name}-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, profile_dir: Path | None = None) -> None:
        """Start it; with ``profile_dir``, under cProfile (stats written when it stops)."""
        args = self.args
        if profile_dir is not None:
            args = ["-m", "cProfile", "-o", str(profile_dir / f"{self.name}.prof"), *args]
        elif self.traced:
            out = str(Path(os.environ["LW_BENCH_TRACEMALLOC"]) / self.name)
            args = ["-m", "tests.bench.traced", out, *args[1:]]
        assert args[0] == "-m", args
        command = [sys.executable, str(_CHILD), str(os.getpid()), *args[1:]]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                command, env=self.env, cwd=self.cwd, stdout=log, stderr=log
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, tail: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def count_in_log(self, needle: str) -> int:
        return self.log_path.read_text(errors="replace").count(needle)

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def kernel(self) -> tuple[float, int]:
        return kernel_use(self.pid)

    def rss(self) -> int:
        return rss_bytes(self.pid)

    async def wait_ready(self, check: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
        if self.traced:
            timeout *= 6  # every allocation is recorded: imports alone take many times longer
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited:\n{self.log()}")
            try:
                if await check():
                    return
            except Exception:
                pass
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{self.name} did not become ready:\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def remove_log(self) -> None:
        self.log_path.unlink(missing_ok=True)


async def http_ok(url: str) -> bool:
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response,
    ):
        return response.status == 200


class CpuMeter:
    """CPU seconds and RSS of a set of processes between ``start()`` and ``stop()``."""

    def __init__(self, procs: list[Proc]) -> None:
        self.procs = procs
        self.cpu0: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def start(self) -> None:
        self.cpu0 = {p.name: p.cpu() for p in self.procs if p.alive()}

    def stop(self) -> dict[str, float]:
        self.cpu = {
            p.name: p.cpu() - self.cpu0[p.name]
            for p in self.procs
            if p.alive() and p.name in self.cpu0
        }
        return self.cpu
