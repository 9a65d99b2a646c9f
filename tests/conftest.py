"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from hypothesis import settings

from worker.testing.scripted_model import ScriptedModel

# The simulation's schedules (tests/unit/simulation): a few dozen in the suite, and
# ``--hypothesis-profile=long`` for a long run (docs/architecture.md).
settings.register_profile("default", max_examples=60)
settings.register_profile("long", max_examples=10_000)


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
