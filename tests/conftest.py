"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from worker.testing.scripted_model import ScriptedModel


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
