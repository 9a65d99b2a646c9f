"""The event loop a worker or a gateway runs on (``LOOPWIRE_EVENT_LOOP``): uvloop by default,
the standard loop when asked; the gateway's command starts its server on the loop its settings
name (a server library's own loop option has no effect on a loop already running)."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import uvloop

from contracts.runtime import event_loop
from gateway.http.settings import GatewaySettings
from worker.cli import gateway as gateway_cli


async def _loop_kind() -> str:
    return "uvloop" if isinstance(asyncio.get_running_loop(), uvloop.Loop) else "asyncio"


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_a_process_runs_on_the_loop_it_names(kind: event_loop.EventLoop) -> None:
    assert event_loop.run(_loop_kind(), kind) == kind


@pytest.mark.parametrize(("env", "expected"), [(None, "uvloop"), ("asyncio", "asyncio")])
def test_the_gateway_serves_on_the_loop_its_settings_name(
    monkeypatch: pytest.MonkeyPatch, env: str | None, expected: str
) -> None:
    if env is None:
        monkeypatch.delenv("LOOPWIRE_EVENT_LOOP", raising=False)
    else:
        monkeypatch.setenv("LOOPWIRE_EVENT_LOOP", env)
    ran_on: list[str] = []

    async def serve(settings: GatewaySettings) -> int:
        ran_on.append(await _loop_kind())
        return 0

    monkeypatch.setattr(gateway_cli, "run_gateway_serve", serve)
    args = argparse.Namespace(
        gateway_command="serve", host=None, port=None, keys_file=None, agents_file=None
    )
    assert gateway_cli.run_gateway_command(args) == 0
    assert ran_on == [expected]
