"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from hypothesis import settings
from suite_watchdog import GRACE_S, Watchdog

from worker.testing.scripted_model import ScriptedModel

# The simulation's schedules (tests/unit/simulation): a few dozen in the suite, and
# ``--hypothesis-profile=long`` for a long run (docs/architecture.md).
settings.register_profile("default", max_examples=60)
settings.register_profile("long", max_examples=10_000)

_watchdog: Watchdog | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _watchdog
    limit = session.config.getini("session_timeout")
    capture = session.config.pluginmanager.getplugin("capturemanager")

    def uncapture() -> None:
        if capture is not None:
            capture.suspend_global_capture(in_=True)

    _watchdog = Watchdog(float(limit) + GRACE_S if limit else None, uncapture)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Each test is watched for its own timeout (the ``timeout`` marker or the ini value)
    plus the watchdog's grace (suite_watchdog.py)."""
    marker = item.get_closest_marker("timeout")
    timeout = marker.args[0] if marker and marker.args else item.config.getini("timeout")
    if _watchdog is not None:
        _watchdog.started(item.nodeid, float(timeout or 0) or 600.0)
    try:
        return (yield)
    finally:
        if _watchdog is not None:
            _watchdog.finished()


@pytest.fixture
async def scripted_model() -> AsyncIterator[ScriptedModel]:
    """A started ScriptedModel; teardown fails the test on unexpected or unconsumed calls."""
    server = ScriptedModel()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
    server.assert_done()
