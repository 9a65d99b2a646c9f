"""The worker's shutdown deadline (``worker.app``): a broker or Redis that stops answering
mid-shutdown (a deleted user, a half-open socket) cannot keep the process alive after SIGTERM.
Past the deadline it logs every thread's stack and exits with status 1; its unacknowledged
steps are redone elsewhere as after a crash."""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback

log = logging.getLogger("loopwire.worker")

SHUTDOWN_SLACK_S = 15.0
"""What shutdown may take beyond ``grace_s`` (closing connections, flushing traces)."""


def exit_after(seconds: float) -> None:
    """Arm the shutdown deadline once: a daemon thread that, if the process is still alive
    after ``seconds``, logs every thread's stack and ends the process with status 1."""
    if getattr(exit_after, "armed", False):
        return
    exit_after.armed = True  # type: ignore[attr-defined]

    def expire() -> None:
        frames = sys._current_frames()
        stacks = "".join(
            f"\n-- thread {ident}\n" + "".join(traceback.format_stack(frame))
            for ident, frame in frames.items()
        )
        log.error("shutdown did not finish within %g s; exiting%s", seconds, stacks)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
