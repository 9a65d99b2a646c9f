"""Fixtures for integration tests against the real RabbitMQ and Redis.

Nothing here skips: when RabbitMQ or Redis is down, every test that needs them
fails with a message saying which one. Every test uses its own names (a uuid
suffix) and removes the queues, Redis keys and registry entries it created;
nothing is flushed, so tests can share the servers with other suites.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import aio_pika
import pytest
from aio_pika.abc import AbstractRobustConnection
from guard import STREAK, services_problem
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from support_rpc import (
    AMQP_URL,
    REDIS_URL,
    RpcCaller,
    drop_announcements,
    ensure_test_vhost,
    service_settings,
)
from tenant_support import drop_intake_queues

from contracts import topology as t
from contracts.client import LoopwireClient
from contracts.tools import ToolCallRequest
from contracts.topology import tool_queue
from harness import AMQP_URL as WORKER_AMQP_URL
from harness import CountingToolService, EventRecorder, free_port, reset_topology
from tool_services.sdk import ToolService
from tool_services.server import ToolServer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", autouse=True)
def test_vhost() -> None:
    ensure_test_vhost()


_failed_in_a_row = 0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Stop the suite when the shared services have gone, or after ``STREAK`` integration
    tests in a row failed (guard.py): the tests after would fail the same way, one timeout
    each, and the run would never end."""
    global _failed_in_a_row
    report = yield
    if report.failed:
        _tell_at_once(item, report)
    if not report.failed:
        if report.when == "call" or report.skipped:
            _failed_in_a_row = 0
        return report
    _failed_in_a_row += 1
    problem = services_problem()
    if problem is None and _failed_in_a_row >= STREAK:
        problem = f"{STREAK} integration tests in a row failed (the first of them shows why)"
    if problem is not None:
        item.session.shouldstop = f"stopping the suite: {problem}"
    return report


SERVICE_LOGS = pytest.StashKey[list[Path]]()
"""Logs of the processes a test started (``spawn``): shown with its failure."""


def _tell_at_once(item: pytest.Item, report: pytest.TestReport) -> None:
    """A failure is printed when it happens, with the tail of each service log the test
    started, and not only in the summary at the end: a run that is later ended from outside
    (or by the watchdog, tests/suite_watchdog.py) still shows why its tests failed."""
    lines = [f"\n{report.when} of {item.nodeid} failed: {report.longreprtext[-3000:]}"]
    for path in item.stash.get(SERVICE_LOGS, []):
        tail = path.read_text(errors="replace").splitlines()[-30:] if path.exists() else []
        lines += [f"--- last lines of {path.name}:", *tail]
    writer = item.config.get_terminal_writer()
    writer.line("\n".join(lines))
    writer.flush()


@pytest.fixture
def uid() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture
async def redis(uid: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(REDIS_URL)
    try:
        await client.ping()
    except Exception as exc:
        await client.aclose()
        pytest.fail(f"Redis is not reachable at {REDIS_URL}: {exc!r}")
    try:
        yield client
    finally:
        # Keys of the test: its turn ids are t-<uid>..., its session ids s-<uid>...
        patterns = (
            f"lw:toolcall:{{t-{uid}*",
            f"lw:test:{uid}:*",
            f"lw:{{s-{uid}*",
            f"lw:turn:t-{uid}*",
        )
        for pattern in patterns:
            async for key in client.scan_iter(match=pattern):
                await client.delete(key)
        await drop_announcements(client, lambda a: uid in a.service)
        await client.aclose()


@pytest.fixture
async def amqp() -> AsyncIterator[AbstractRobustConnection]:
    try:
        connection = await aio_pika.connect_robust(AMQP_URL, reconnect_interval=1)
    except Exception as exc:
        pytest.fail(f"RabbitMQ is not reachable at {AMQP_URL}: {exc!r}")
    try:
        yield connection
    finally:
        await connection.close()


@pytest.fixture
async def caller(amqp: AbstractRobustConnection) -> AsyncIterator[RpcCaller]:
    rpc = RpcCaller(amqp)
    await rpc.start()
    try:
        yield rpc
    finally:
        await rpc.close()


@pytest.fixture
async def queues(amqp: AbstractRobustConnection) -> AsyncIterator[list[str]]:
    """Names of tool queues the test caused to exist; deleted at teardown."""
    names: list[str] = []
    yield names
    channel = await amqp.channel()
    try:
        for name in names:
            await channel.queue_delete(name)
    finally:
        await channel.close()


ServeFn = Callable[..., Awaitable[ToolServer]]


@pytest.fixture
async def serve(queues: list[str], redis: Redis) -> AsyncIterator[ServeFn]:
    """``await serve(service, **tool_settings)``: a started in-process ``ToolServer``."""
    servers: list[ToolServer] = []

    async def start(service: ToolService, **tools: Any) -> ToolServer:
        queues.extend(tool_queue(name) for name in service.tools)
        server = ToolServer(service, service_settings(**tools))
        await server.start()
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            await server.stop()


class Spawned:
    """A tool service running as a subprocess (``python -m <module>``)."""

    def __init__(self, process: asyncio.subprocess.Process, log: Path) -> None:
        self.process = process
        self.log = log

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    async def wait(self, timeout: float = 30) -> int:
        async with asyncio.timeout(timeout):
            return await self.process.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


SpawnFn = Callable[..., Awaitable[Spawned]]


@pytest.fixture
async def spawn(
    tmp_path: Path, queues: list[str], request: pytest.FixtureRequest
) -> AsyncIterator[SpawnFn]:
    """``await spawn(module, tool=..., env={...})``: start a tool service subprocess."""
    spawned: list[Spawned] = []
    request.node.stash[SERVICE_LOGS] = logs = []

    async def start(module: str, *, tool: str, env: dict[str, str]) -> Spawned:
        queues.append(tool_queue(tool))
        log = tmp_path / f"service-{len(spawned)}.log"
        logs.append(log)
        full_env = {
            **os.environ,
            "LOOPWIRE_AMQP_URL": AMQP_URL,
            "LOOPWIRE_REDIS_URL": REDIS_URL,
            **env,
        }
        with log.open("wb") as sink:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                module,
                cwd=REPO,
                env=full_env,
                stdout=sink,
                stderr=sink,
            )
        child = Spawned(process, log)
        spawned.append(child)
        return child

    try:
        yield start
    finally:
        for child in spawned:
            if child.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
            with contextlib.suppress(TimeoutError):  # a kill that does not end it: move on
                await asyncio.wait_for(child.process.wait(), 15)


# -- fixtures of the distributed-worker tests -------------------------------------------------


@pytest.fixture
async def topology() -> None:
    """The topology declared and the turn queues empty, so no earlier test's work leaks in."""
    await reset_topology()


@pytest.fixture
async def client(topology: None) -> AsyncIterator[LoopwireClient]:
    async with LoopwireClient(WORKER_AMQP_URL) as c:
        yield c


@pytest.fixture
async def lookup() -> AsyncIterator[CountingToolService]:
    """A search-like tool: ``{"results": ["found <q>"]}``, empty for q == "nothing"."""

    async def body(request: ToolCallRequest) -> object:
        q = str(request.arguments.get("q", ""))
        return {"results": [f"found {q}"]} if q != "nothing" else {"results": []}

    service = CountingToolService(f"lookup_{uuid.uuid4().hex[:8]}", body)
    await service.start()
    yield service
    await service.stop()


@pytest.fixture
async def events() -> AsyncIterator[EventRecorder]:
    recorder = EventRecorder()
    await recorder.start()
    yield recorder
    await recorder.stop()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[tuple[str, tuple[Callable[[], None], ...]]]:
    """A redis-server of this test's own, so it can be stopped without touching the shared one."""
    port = free_port()
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    command += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(tmp_path)]
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if subprocess.run(
                ["redis-cli", "-p", str(port), "ping"], capture_output=True, check=False
            ).stdout.startswith(b"PONG"):
                return
            time.sleep(0.05)
        raise RuntimeError("private redis did not start")

    def stop() -> None:
        procs[-1].kill()
        procs[-1].wait(10)

    start()
    yield f"redis://127.0.0.1:{port}/0", (start, stop)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# -- the tenants' tests: RabbitMQ users of their own ------------------------------------------

TENANT_VHOST = unquote(urlsplit(AMQP_URL).path[1:]) or "/"


def _rabbitmqctl(*args: str) -> None:
    tool = shutil.which("rabbitmqctl")
    assert tool, "rabbitmqctl is not installed"
    subprocess.run([tool, "-q", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def tenant_users() -> Iterator[dict[str, str]]:
    """Tenant -> the AMQP URL of a user of its own with the shipped publisher's permissions
    (``deploy/rabbitmq/definitions.json``), allowed to bind only its own events
    (docs/tenants.md)."""
    definitions = json.loads((REPO / "deploy/rabbitmq/definitions.json").read_text())
    (grant,) = (g for g in definitions["permissions"] if g["user"] == "loopwire-publisher")
    uid = uuid.uuid4().hex[:8]
    urls = {}
    for tenant in ("acme", "globex"):
        user, password = f"lwt-{tenant}-{uid}", uuid.uuid4().hex
        _rabbitmqctl("add_user", user, password)
        _rabbitmqctl(
            "set_permissions", "-p", TENANT_VHOST, user,
            grant["configure"], grant["write"], grant["read"],
        )  # fmt: skip
        # topic permissions on the events: bind (read) only keys of its own tenant
        _rabbitmqctl(
            "set_topic_permissions", "-p", TENANT_VHOST, user, t.EVENTS_EXCHANGE, "^$",
            f"^{tenant}\\.",
        )  # fmt: skip
        # and on the intake: publish only with its own tenant's key
        _rabbitmqctl(
            "set_topic_permissions", "-p", TENANT_VHOST, user, t.INTAKE_EXCHANGE,
            f"^{tenant}\\.turns$", "^$",
        )  # fmt: skip
        address = urlsplit(AMQP_URL)
        where = f"{address.hostname}:{address.port or 5672}/{quote(TENANT_VHOST, safe='')}"
        urls[tenant] = f"amqp://{user}:{password}@{where}"
    _forget_tenants(("acme", "globex"))  # what an earlier run that failed midway left
    try:
        yield urls
    finally:
        _forget_tenants(("acme", "globex"))
        drop_intake_queues(("acme", "globex"))
        for url in urls.values():
            user = url.split("//")[1].split(":")[0]
            subprocess.run(["rabbitmqctl", "-q", "delete_user", user], capture_output=True)


def _forget_tenants(tenants: tuple[str, ...]) -> None:
    """The keys of the tests' own tenants outside their sessions (lines, slots, approvals,
    spend, rate limits): each test's sessions are its own, these are the tenant's."""
    client = SyncRedis.from_url(REDIS_URL)
    try:
        for tenant in tenants:
            for pattern in (
                f"lw:tenant:{{{tenant}}}:*",
                f"lw:approvals:{tenant}:*",
                f"lw:spend:tenant:{tenant}:*",
                f"lw:rate:{{tenant:{tenant}}}:*",
            ):
                for key in client.scan_iter(match=pattern):
                    client.delete(key)
    finally:
        client.close()
