"""A newcomer's first hour, as the documents tell it: a clone of this checkout, the README's two
commands, the walk-through of docs/operations.md ("Running it by hand": the demo model, a worker,
the tool services, a tail, a turn, an approval) and the pika publisher of docs/protocol.md.

The commands are the documents' own, read from their code blocks, with three substitutions a
test needs on a shared machine: the vhost and Redis database are the tests' (the walk-through
says to use ones of your own), and the ports and the agents file's path are free ones. The clone
uses this checkout's ``.venv`` (nothing is downloaded); ``.ci/run`` installs a fresh one.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import aiohttp
import pytest
from redis.asyncio import Redis
from support_rpc import wait_until

from contracts import topology as t
from contracts.codec import encode
from contracts.events import TurnAccepted, make_event
from contracts.registry import live_tools
from harness import AMQP_URL, REDIS_URL, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
QUESTION_TOOLS = {"search", "calculate", "file_note"}


def section(path: Path, heading: str) -> str:
    """The text under ``heading`` up to the next heading of its level or above."""
    text = path.read_text(encoding="utf-8")
    level = len(heading.split(" ", 1)[0])
    start = text.index(heading + "\n") + len(heading)
    end = re.search(rf"^#{{1,{level}}} ", text[start:], re.M)
    return text[start : start + end.start()] if end else text[start:]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.S | re.M)


class Processes:
    """The long-running commands of the walk-through, each in a terminal of its own: stopped
    (SIGTERM, then SIGKILL) at the end, their output kept for the failure message."""

    def __init__(self, folder: Path, env: dict[str, str], cwd: Path) -> None:
        self.folder, self.env, self.cwd = folder, env, cwd
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, command: str, **env: str) -> subprocess.Popen[bytes]:
        with (self.folder / f"{name}.log").open("wb") as log:
            process = subprocess.Popen(
                shlex.split(command),
                cwd=self.cwd,
                env={**self.env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.running[name] = process
        return process

    def output(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def check(self) -> None:
        for name, process in self.running.items():
            assert process.poll() is None or name == "turn", f"{name} exited:\n{self.output(name)}"

    def stop(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.running.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A clone of this checkout with this checkout's ``.venv``, as installed (the clone's
    ``pyproject.toml`` is no newer than the install, so the scripts install nothing)."""
    target = tmp_path / "loopwire"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(target)], check=True, timeout=60)
    venv = Path(sys.prefix)
    installed = venv / ".installed"
    assert installed.exists(), f"{installed} is missing: run ./scripts/test once to install .venv"
    (target / ".venv").symlink_to(venv)
    stamp = installed.stat().st_mtime - 1
    os.utime(target / "pyproject.toml", (stamp, stamp))
    return target


@pytest.fixture
def newcomer_env(tmp_path: Path) -> dict[str, str]:
    """The environment of every terminal: the tests' vhost and Redis database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPWIRE_")}
    return {
        **env,
        "LOOPWIRE_AMQP_URL": AMQP_URL,
        "LOOPWIRE_REDIS_URL": REDIS_URL,
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": str(tmp_path),
    }


@pytest.fixture
def processes(tmp_path: Path, clone: Path, newcomer_env: dict[str, str]) -> Iterator[Processes]:
    folder = tmp_path / "terminals"
    folder.mkdir()
    running = Processes(folder, newcomer_env, clone)
    try:
        yield running
    finally:
        running.stop()


def run(command: str, cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    done = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return done.stdout


async def test_the_readme_the_walk_through_and_the_pika_recipe_work_from_a_clone(
    topology: None,
    clone: Path,
    newcomer_env: dict[str, str],
    processes: Processes,
    tmp_path: Path,
) -> None:
    readme = (clone / "README.md").read_text()
    assert "./scripts/demo" in readme and "./scripts/test" in readme
    demo = await asyncio.to_thread(run, "./scripts/demo", clone, newcomer_env)
    assert "answer: " in demo
    # the second command runs the whole suite; here one file of it shows it runs from a clone
    await asyncio.to_thread(run, "./scripts/test -q tests/unit/test_readme.py", clone, newcomer_env)

    walk = section(clone / "docs/operations.md", "## Running it by hand")
    (own, model, agents, worker, tools, tail, turn, approvals) = blocks(walk, "sh")
    assert "export LOOPWIRE_AMQP_URL=" in own and "export LOOPWIRE_REDIS_URL=" in own
    model_port, worker_port = free_port(), free_port()
    processes.start("model", model.strip().replace("8099", str(model_port)))
    agents_file = tmp_path / "agents.json"
    await asyncio.to_thread(
        run,
        agents.replace("/tmp/loopwire-demo-agents.json", str(agents_file)),
        clone,
        processes.env,
    )
    assignments, _, command = worker.strip().partition(" .venv/")
    settings = dict(word.split("=", 1) for word in shlex.split(assignments))
    settings["LOOPWIRE_AGENTS_FILE"] = str(agents_file)
    settings["LOOPWIRE_MODEL__BASE_URL"] = settings["LOOPWIRE_MODEL__BASE_URL"].replace(
        "8099", str(model_port)
    )
    processes.start("worker", ".venv/" + command, LOOPWIRE_HTTP_PORT=str(worker_port), **settings)
    for line in tools.strip().splitlines():
        processes.start(line.rsplit(".", 1)[1], line)
    await ready(processes, worker_port)
    processes.start("tail", tail.strip())
    await tail_listening(processes)

    processes.start("turn", turn.strip())
    await wait_until(lambda: "approval.requested" in processes.output("tail"), timeout=60)
    listed, approve = approvals.strip().splitlines()
    waiting = await asyncio.to_thread(run, listed, clone, processes.env)
    [row] = [line for line in waiting.splitlines() if "demo/file_note" in line]
    turn_id, call_id = row.split()[:2]
    command = approve.replace("TURN_ID", turn_id).replace("CALL_ID", call_id)
    await asyncio.to_thread(run, command, clone, processes.env)
    answer = await asyncio.to_thread(processes.running["turn"].wait, 60)
    assert answer == 0, processes.output("turn")
    assert "17 * 23 = 391" in processes.output("turn")
    await wait_until(lambda: "turn.completed" in processes.output("tail"), timeout=20)
    assert "approval.decided" in processes.output("tail")

    recipe = section(clone / "docs/protocol.md", "### A whole publisher with pika")
    [script] = blocks(recipe, "python")
    (clone / "publish.py").write_text(script)
    [usage] = re.findall(r"`(\.venv/bin/python publish\.py [^`]+)`", recipe)
    published = await asyncio.to_thread(run, usage, clone, processes.env)
    assert "answer (stop): " in published, published
    assert "tool.invoked" in published  # its events came on its queue too
    refused = subprocess.run(
        [".venv/bin/python", "publish.py", "nobody", "hi"],
        cwd=clone,
        env=processes.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and "rejected (unknown_agent)" in refused.stderr


async def tail_listening(processes: Processes, timeout: float = 20) -> None:
    """Wait until ``loopwire tail`` prints events: a probe event is published until one shows
    (the tail prints nothing before its queue is bound)."""
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.get_exchange(t.EVENTS_EXCHANGE)
        deadline = time.monotonic() + timeout
        while "probe-" not in processes.output("tail"):
            processes.check()
            assert time.monotonic() < deadline, "loopwire tail printed nothing"
            probe = make_event(
                "turn.accepted",
                TurnAccepted(persist=True, input_messages=1),
                agent="probe",
                time=time.time(),
                turn_id=f"probe-{uuid.uuid4().hex}",
            )
            await exchange.publish(
                aio_pika.Message(encode(probe), headers=probe.headers()),
                routing_key=probe.routing_key,
            )
            await asyncio.sleep(0.2)


async def ready(processes: Processes, worker_port: int, timeout: float = 60) -> None:
    """The worker's ``/readyz`` answers 200 and the three tool services are announced."""
    redis = Redis.from_url(REDIS_URL)
    deadline = time.monotonic() + timeout
    try:
        async with aiohttp.ClientSession() as http:
            while True:
                processes.check()
                tools = set(await live_tools(redis))
                try:
                    async with http.get(f"http://127.0.0.1:{worker_port}/readyz") as response:
                        up = response.status == 200
                except aiohttp.ClientError:
                    up = False
                if up and tools >= QUESTION_TOOLS:
                    return
                assert time.monotonic() < deadline, f"not ready: {processes.output('worker')}"
                await asyncio.sleep(0.1)
    finally:
        await redis.aclose()
