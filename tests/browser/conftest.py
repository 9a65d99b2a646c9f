"""Fixtures for tests that drive the machine's Chromium through Playwright (async API).

Every test here is marked ``browser``. The browser is launched per test: the tests run in
pytest-asyncio's per-test event loop, and a Playwright connection belongs to the loop that
opened it, so one browser cannot serve the whole session without moving every test (and every
async fixture it uses) to a session-wide loop. A launch costs about a second.

Each test's page is saved as ``artifacts/<test name>.png`` when the test ends; when it failed,
what the page wrote to its console (and its uncaught errors, and the requests that failed) goes
to ``artifacts/<test name>.console.txt``, and the failure report names both files.

Helpers (``assert_accessible``, ``serve``) are in browser_support.py, imported by the tests.
The console's tests run a worker, the gateway and tool services as the integration tests do,
with the integration suite's fixtures (its conftest, loaded here under another name, and its
helper modules on the path).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import AsyncIterator, Generator
from pathlib import Path
from types import ModuleType

import pytest
from browser_support import ARTIFACTS, launch_chromium
from playwright.async_api import Browser, ConsoleMessage, Page, Request, async_playwright
from playwright.async_api import Error as PlaywrightError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration"))


def _integration_fixtures() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "integration_fixtures", HERE.parent / "integration" / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if (HERE.parent / "integration" / "conftest.py").exists():  # not in a copy (test_harness.py)
    _fixtures = _integration_fixtures()
    test_vhost = _fixtures.test_vhost
    uid = _fixtures.uid
    redis = _fixtures.redis
    amqp = _fixtures.amqp
    topology = _fixtures.topology
    lookup = _fixtures.lookup

REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()
"""The reports of a test's phases so far ("setup", "call"), for its fixtures' teardown."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.browser)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    item.stash.setdefault(REPORTS, {})[report.when] = report
    return report


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """Debian's Chromium, headless, launched for this test."""
    async with async_playwright() as playwright:
        launched = await launch_chromium(playwright)
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
def console_log() -> list[str]:
    """What the test's page wrote to its console, its uncaught errors and its failed requests,
    a line each, as they come."""
    return []


@pytest.fixture
async def page(
    browser: Browser, console_log: list[str], request: pytest.FixtureRequest
) -> AsyncIterator[Page]:
    """A page in a fresh browser context; screenshot and console log kept as the module
    docstring says."""
    context = await browser.new_context()
    opened = await context.new_page()
    opened.on("console", lambda message: console_log.append(_console_line(message)))
    opened.on("pageerror", lambda error: console_log.append(f"pageerror: {error}"))
    opened.on("requestfailed", lambda r: console_log.append(_failed_request_line(r)))
    try:
        yield opened
    finally:
        try:
            await _keep_artifacts(opened, console_log, request.node)
        finally:
            await context.close()


async def _keep_artifacts(page: Page, console_log: list[str], item: pytest.Item) -> None:
    name = re.sub(r"[^\w.\[\]-]", "_", item.name)
    screenshot = ARTIFACTS / f"{name}.png"
    console_file = ARTIFACTS / f"{name}.console.txt"
    ARTIFACTS.mkdir(exist_ok=True)
    failed = next((r for r in item.stash.get(REPORTS, {}).values() if r.failed), None)
    try:
        await page.screenshot(path=screenshot, full_page=True)
    except PlaywrightError as exc:
        if failed is None:
            raise
        console_log.append(f"(no screenshot: {exc.message})")
        screenshot.unlink(missing_ok=True)
    if failed is None:
        console_file.unlink(missing_ok=True)  # left by an earlier run that failed
        return
    console_file.write_text("".join(f"{line}\n" for line in console_log))
    kept = [p for p in (screenshot, console_file) if p.exists()]
    failed.sections.append(("browser artifacts", "\n".join(str(p) for p in kept)))


def _console_line(message: ConsoleMessage) -> str:
    where = message.location
    line = f"{message.type}: {message.text}"
    if where.get("url"):
        line += f" ({where['url']}:{where.get('lineNumber', 0)})"
    return line


def _failed_request_line(request: Request) -> str:
    return f"requestfailed: {request.method} {request.url}: {request.failure}"
