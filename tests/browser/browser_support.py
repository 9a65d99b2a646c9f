"""What browser tests share besides their fixtures (conftest.py): the machine's Chromium and how
it is started, an ASGI app served in-process on a free local port, and the accessibility check."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from axe_playwright_python.async_playwright import Axe  # type: ignore[import-untyped]
from playwright.async_api import Browser, Page, Playwright
from starlette.types import ASGIApp

CHROMIUM = Path("/usr/bin/chromium")
"""Debian's package (scripts/lib.sh installs it): Playwright does not download browsers here."""

CHROMIUM_ARGS = [
    "--no-sandbox",  # tests run as root, where Chromium's sandbox refuses to start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # Without these Chromium reaches out to Google's services at start and, on a machine
    # without Internet access, hangs on those connections.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
"""Each test's last screenshot, and the console log of a test that failed (git-ignored)."""

BLOCKING_IMPACTS = ("serious", "critical")
"""The axe-core impacts that fail ``assert_accessible``; "minor" and "moderate" do not."""


def require_chromium() -> None:
    if not CHROMIUM.exists():
        raise RuntimeError(
            f"{CHROMIUM} is missing: install Debian's chromium package "
            "(./scripts/test does, through scripts/lib.sh)"
        )


async def launch_chromium(playwright: Playwright) -> Browser:
    require_chromium()
    return await playwright.chromium.launch(
        executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
    )


async def assert_accessible(page: Page) -> None:
    """Run axe-core on the page as it is now; fail listing each violation whose impact is
    serious or critical: its rule, impact, what it asks for and the elements that break it."""
    results = await Axe().run(page)
    violations: list[dict[str, Any]] = results.response["violations"]
    blocking = [v for v in violations if v.get("impact") in BLOCKING_IMPACTS]
    if not blocking:
        return
    lines = [f"{len(blocking)} serious or critical accessibility violation(s) on {page.url}:"]
    for violation in blocking:
        lines.append(f"- {violation['id']} ({violation['impact']}): {violation['help']}")
        for node in violation["nodes"]:
            lines.append(f"    {', '.join(str(t) for t in node['target'])}")
    raise AssertionError("\n".join(lines))


@asynccontextmanager
async def serve(app: ASGIApp, *, graceful_s: int = 5) -> AsyncIterator[str]:
    """``async with serve(app) as url``: the app served by uvicorn in this event loop on a
    free port of 127.0.0.1 (``url`` is ``http://127.0.0.1:<port>``), stopped on the way out.

    Open streams (server-sent events) are cut after ``graceful_s`` seconds of the stop."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # bound here and handed over: no other process can take it
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        http="httptools",  # as the gateway serves
        ws="none",
        timeout_graceful_shutdown=graceful_s,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                await task
                raise RuntimeError("uvicorn stopped before it served")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()
