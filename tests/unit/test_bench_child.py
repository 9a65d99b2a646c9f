"""The benchmark's children stop when the benchmark process dies, even when it is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = Path(__file__).resolve().parents[1] / "bench" / "child.py"


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # exited (a zombie until whoever inherited it reaps it)


def _wait(condition: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_a_child_runs_its_module_and_stops_when_the_benchmark_is_killed(tmp_path: Path) -> None:
    (tmp_path / "sleeper.py").write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "Path('started').write_text(' '.join(sys.argv))\n"
        "time.sleep(60)\n"
    )
    bench = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, {str(CHILD)!r}, str(os.getpid()), "
            "'sleeper', '--flag'])\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(60)\n",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert bench.stdout is not None
    child = int(bench.stdout.readline())
    try:
        started = tmp_path / "started"
        assert _wait(started.exists), "the module did not run (found from the working directory)"
        argv0, *args = started.read_text().split(" ")
        assert argv0 == str(tmp_path / "sleeper.py") and args == ["--flag"], "as `python -m`"
        assert not _gone(child)
        bench.send_signal(signal.SIGKILL)
        bench.wait(10)
        assert _wait(lambda: _gone(child)), "the child outlived the killed benchmark"
    finally:
        bench.kill()
        bench.wait(10)
        bench.stdout.close()
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
