"""The suite's last line against a run that never ends.

pytest-timeout's signal method fails a test by raising inside whatever the test is running;
when that lands where the exception is swallowed, or a teardown then waits on something that
will never come, nothing times the test out again and the run hangs until the CI job is
killed, printing nothing. This thread does not depend on the test's code: when one test
(setup, call and teardown) has run ``GRACE_S`` past its own timeout, or the session past its
``session_timeout``, it prints which test, every thread's stack, and ends the process with
``EXIT_CODE``, so the run fails with the reason in its log."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable

GRACE_S = float(os.environ.get("LOOPWIRE_TEST_WATCHDOG_GRACE_S", "120"))
"""Past a test's own timeout, before the process is ended."""
EXIT_CODE = 70
"""The exit status of a run the watchdog ended."""


class Watchdog:
    def __init__(self, session_limit_s: float | None, uncapture: Callable[[], None]) -> None:
        self.uncapture = uncapture
        self.session_deadline = (
            None if session_limit_s is None else time.monotonic() + session_limit_s
        )
        self.test: str | None = None
        self.test_deadline: float | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="suite-watchdog", daemon=True).start()

    def started(self, nodeid: str, timeout_s: float) -> None:
        with self._lock:
            self.test = nodeid
            self.test_deadline = time.monotonic() + timeout_s + GRACE_S

    def finished(self) -> None:
        with self._lock:
            self.test, self.test_deadline = None, None

    def _watch(self) -> None:
        while True:
            time.sleep(5)
            now = time.monotonic()
            with self._lock:
                test, deadline = self.test, self.test_deadline
            if deadline is not None and now > deadline:
                self._end(f"{test} ran {GRACE_S:.0f} s past its own timeout")
            if self.session_deadline is not None and now > self.session_deadline:
                self._end(f"the session ran past its session_timeout (in {test or 'no test'})")

    def _end(self, why: str) -> None:
        with contextlib.suppress(Exception):  # ending anyway; the output may go to a capture
            self.uncapture()  # pytest's capture holds fds 1 and 2 during a test
        for stream in (sys.__stdout__, sys.__stderr__):
            if stream is None:
                continue
            try:
                stream.write(f"\n\nwatchdog: ending the test run: {why}; every thread's stack:\n")
                stream.flush()
                faulthandler.dump_traceback(file=stream, all_threads=True)
                stream.flush()
            except (OSError, ValueError):
                continue
        os._exit(EXIT_CODE)
