"""The browser harness itself: a page served in-process, driven as a person would, checked for
accessibility; the check can fail; a failing test leaves its screenshot and console log."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from browser_support import assert_accessible, serve
from playwright.async_api import Page, expect
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

HERE = Path(__file__).resolve().parent

GREETER = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>Greeter</title></head>
<body>
<main>
  <h1>Greeter</h1>
  <button type="button" id="greet">Greet</button>
  <p role="status" id="greeting">Nobody greeted yet</p>
</main>
<script src="/greeter.js"></script>
</body>
</html>
"""

GREETER_JS = """
document.getElementById("greet").addEventListener("click", () => {
  document.getElementById("greeting").textContent = "Hello, operator";
  console.log("greeted");
});
"""

UNLABELLED = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>Unlabelled</title></head>
<body>
<main>
  <h1>Unlabelled</h1>
  <img src="/pixel.png" id="logo">
  <input type="text" id="query">
</main>
</body>
</html>
"""


async def greeter(request: Request) -> Response:
    return HTMLResponse(GREETER)


async def greeter_js(request: Request) -> Response:
    return Response(GREETER_JS, media_type="text/javascript")


async def unlabelled(request: Request) -> Response:
    return HTMLResponse(UNLABELLED)


APP = Starlette(
    routes=[
        Route("/", greeter),
        Route("/greeter.js", greeter_js),
        Route("/unlabelled", unlabelled),
    ]
)


async def test_a_person_clicks_a_button_and_sees_the_text_change(
    page: Page, console_log: list[str]
) -> None:
    async with serve(APP) as url:
        await page.goto(url)
        status = page.get_by_role("status")
        await expect(status).to_have_text("Nobody greeted yet")
        await page.get_by_role("button", name="Greet").click()
        await expect(status).to_have_text("Hello, operator")
        await assert_accessible(page)
    assert "log: greeted" in "\n".join(console_log)


async def test_an_image_without_alt_text_and_an_unlabelled_input_are_reported(
    page: Page,
) -> None:
    async with serve(APP) as url:
        await page.goto(f"{url}/unlabelled")
        with pytest.raises(AssertionError) as failed:
            await assert_accessible(page)
    said = str(failed.value)
    assert "- image-alt (critical)" in said
    assert "#logo" in said
    assert "- label (critical)" in said
    assert "#query" in said


FAILING_TESTS = """
from playwright.async_api import Page


async def test_fails(page: Page) -> None:
    await page.set_content(
        "<title>t</title><script>console.error('went wrong'); undefinedThing();</script>"
    )
    assert False, "on purpose"


async def test_passes(page: Page) -> None:
    await page.set_content("<title>t</title><script>console.log('fine')</script>")
"""


def test_a_failing_test_leaves_its_screenshot_and_console_log(tmp_path: Path) -> None:
    """Run by a pytest of its own, in a copy of this directory's conftest and support."""
    for name in ("conftest.py", "browser_support.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "test_on_purpose.py").write_text(FAILING_TESTS)
    (tmp_path / "pytest.ini").write_text(
        textwrap.dedent(
            """
            [pytest]
            asyncio_mode = auto
            asyncio_default_fixture_loop_scope = function
            filterwarnings = error
            addopts = --strict-markers
            markers = browser: drives the machine's Chromium through Playwright
            """
        )
    )
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_on_purpose.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=50,
    )
    out = ran.stdout + ran.stderr
    assert ran.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    artifacts = tmp_path / "artifacts"
    screenshot = artifacts / "test_fails.png"
    console = artifacts / "test_fails.console.txt"
    assert "browser artifacts" in out, out
    assert str(screenshot) in out, out
    assert str(console) in out, out
    assert screenshot.read_bytes().startswith(b"\x89PNG")
    logged = console.read_text()
    assert "error: went wrong" in logged
    assert "pageerror: undefinedThing is not defined" in logged
    assert (artifacts / "test_passes.png").exists()
    assert not (artifacts / "test_passes.console.txt").exists()
