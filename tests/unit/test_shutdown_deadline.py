"""A worker whose shutdown hangs (a broker that stops answering mid-shutdown) still exits:
the deadline armed on SIGTERM ends the process with status 1 and says what it was doing."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HANGS = """
import time
from worker.runtime.shutdown import exit_after
exit_after(0.5)
exit_after(60)  # armed once: a second SIGTERM does not move the deadline
def waiting_for_the_broker():
    time.sleep(60)
waiting_for_the_broker()
"""


def test_a_hung_shutdown_ends_at_the_deadline_with_the_stacks() -> None:
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", HANGS], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 1
    assert time.monotonic() - began < 20
    assert "shutdown did not finish within 0.5 s; exiting" in done.stderr
    assert "waiting_for_the_broker" in done.stderr
