"""Every role under its own restricted user, as ``deploy/`` ships them: the RabbitMQ
permissions of ``deploy/rabbitmq/definitions.json`` (applied to a vhost of the test's own on the
shared broker, to users of its own) and the Redis ACL users of ``deploy/redis/users.acl`` (a
``redis-server`` of the test's own, loaded with that file). A turn with a tool step runs with
the worker, the calculator service and the publisher each under its role; then what each role
may not do is refused; and none of the passwords appears in a log, an error, ``/readyz`` or
the CLI's output. The docs' pika publisher (docs/protocol.md) runs as the publisher role."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import aio_pika
import aiohttp
import pytest
from aiormq.exceptions import ChannelAccessRefused
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError

from contracts import keys
from contracts import topology as t
from contracts.client import LoopwireClient, new_id
from tests.integration.harness import WorkerProcess, free_port
from worker.testing.scripted_model import Reply, ScriptedModel
from worker.transport.topology import TURNS_ARGUMENTS

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
DEFINITIONS = ROOT / "deploy/rabbitmq/definitions.json"
ACL = ROOT / "deploy/redis/users.acl"
ROLES = ("loopwire-worker", "loopwire-tools", "loopwire-publisher", "loopwire-keda")


def recipe(heading: str) -> str:
    """The one Python block under ``heading`` in docs/protocol.md."""
    text = (ROOT / "docs/protocol.md").read_text(encoding="utf-8")
    start = text.index(heading + "\n")
    body = text[start : start + text[start:].index("\n### ", 1)]
    [script] = re.findall(r"^```python\n(.*?)^```$", body, re.S | re.M)
    return str(script)


@dataclass(frozen=True)
class Roles:
    vhost: str
    users: dict[str, str]  # role -> broker user
    passwords: dict[str, str]  # role -> password (broker and Redis alike)
    redis_port: int

    def amqp(self, role: str) -> str:
        user, password = self.users[role], self.passwords[role]
        return f"amqp://{user}:{password}@127.0.0.1:5672/{quote(self.vhost, safe='')}"

    def redis(self, role: str) -> str:
        return f"redis://{role}:{self.passwords[role]}@127.0.0.1:{self.redis_port}/0"


def rabbitmqctl(*args: str) -> None:
    tool = shutil.which("rabbitmqctl")
    assert tool, "rabbitmqctl is not installed"
    subprocess.run([tool, "-q", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def broker_roles() -> Iterator[tuple[str, dict[str, str], dict[str, str]]]:
    """The shipped permissions, each role's, for users and a vhost of this test's own."""
    uid = uuid.uuid4().hex[:8]
    vhost = f"lw_roles_{uid}"
    definitions = json.loads(DEFINITIONS.read_text())
    assert {u["name"] for u in definitions["users"]} == set(ROLES)
    users = {role: f"{role}-{uid}" for role in ROLES}
    passwords = {role: f"pw-{role}-{uuid.uuid4().hex}" for role in ROLES}
    rabbitmqctl("add_vhost", vhost)
    try:
        for grant in definitions["permissions"]:
            role = grant["user"]
            rabbitmqctl("add_user", users[role], passwords[role])
            tags = next(u["tags"] for u in definitions["users"] if u["name"] == role)
            rabbitmqctl("set_user_tags", users[role], *tags)
            rabbitmqctl(
                "set_permissions", "-p", vhost, users[role],
                grant["configure"], grant["write"], grant["read"],
            )  # fmt: skip
        yield vhost, users, passwords
    finally:
        for user in users.values():
            subprocess.run(["rabbitmqctl", "-q", "delete_user", user], capture_output=True)
        subprocess.run(["rabbitmqctl", "-q", "delete_vhost", vhost], capture_output=True)


@pytest.fixture(scope="module")
def roles(
    broker_roles: tuple[str, dict[str, str], dict[str, str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Roles]:
    """A ``redis-server`` of the test's own loaded with the shipped ACL file (plus an admin for
    the test), each role's password set as an operator would from its secret."""
    vhost, users, passwords = broker_roles
    server = shutil.which("redis-server")
    assert server, "redis-server is not installed"
    folder = tmp_path_factory.mktemp("acl")
    admin = f"admin-{uuid.uuid4().hex}"
    acl = folder / "users.acl"
    acl.write_text(ACL.read_text() + f"user admin on >{admin} ~* &* +@all\n")
    port = free_port()
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--aclfile", str(acl), "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        cli = [
            "redis-cli",
            "-p",
            str(port),
            "--user",
            "admin",
            "--pass",
            admin,
            "--no-auth-warning",
        ]
        for _ in range(100):
            if subprocess.run([*cli, "ping"], capture_output=True, text=True).stdout == "PONG\n":
                break
            time.sleep(0.05)
        for role in ("loopwire-worker", "loopwire-tools"):
            subprocess.run([*cli, "ACL", "SETUSER", role, f">{passwords[role]}"], check=True)
        yield Roles(vhost, users, passwords, port)
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
async def calculator(roles: Roles, tmp_path: Path) -> AsyncIterator[tuple[Path, int]]:
    log = tmp_path / "calculator.log"
    http_port = free_port()
    env = {
        **os.environ,
        "LOOPWIRE_AMQP_URL": roles.amqp("loopwire-tools"),
        "LOOPWIRE_REDIS_URL": roles.redis("loopwire-tools"),
        "LOOPWIRE_TOOLS__HTTP_PORT": str(http_port),
        "LOOPWIRE_LOG_LEVEL": "DEBUG",
    }
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "tool_services.calculator"],
            env=env, cwd=ROOT, stdout=sink, stderr=sink,
        )  # fmt: skip
    try:
        yield log, http_port
    finally:
        process.terminate()
        process.wait(30)


async def body_of(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.text()


async def test_every_role_runs_a_turn_under_its_own_user_and_no_further(
    roles: Roles, calculator: tuple[Path, int], scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    scripted_model.expect(Reply.tool_calls(("calculate", {"expression": "6*7"})))
    scripted_model.expect(Reply.text("It is 42."), check=lambda body: "42" in json.dumps(body))
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps({"agents": [{"name": "support", "tools": ["calculate"]}]}))
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents,
        redis_url=roles.redis("loopwire-worker"),
        extra_env={"LOOPWIRE_AMQP_URL": roles.amqp("loopwire-worker")},
    )
    async with worker:
        async with LoopwireClient(roles.amqp("loopwire-publisher")) as client:
            assert client.requests.name == t.REQUESTS_EXCHANGE
            deadline = time.monotonic() + 30  # the calculator announces itself
            while True:
                result = await client.run_turn(
                    "support", "6 times 7?", session_id=new_id(), timeout=30
                )
                if result.steps == 2 or time.monotonic() > deadline:
                    break
                scripted_model.expect(Reply.tool_calls(("calculate", {"expression": "6*7"})))
                scripted_model.expect(Reply.text("It is 42."))
            # a cancel goes where the publisher may write (refused: the channel would close)
            await client.cancel(result.turn_id, session_id=result.session_id)
            ready = await body_of(f"http://127.0.0.1:{worker.port}/readyz")
            cli = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "worker.cli", "--amqp-url", roles.amqp("loopwire-publisher"),
                 "result", result.turn_id],
                capture_output=True, text=True, cwd=ROOT, timeout=60,
            )  # fmt: skip
            refused_cli = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "worker.cli", "--amqp-url",
                 roles.amqp("loopwire-publisher").replace("5672", "1"), "turn", "hi"],
                capture_output=True, text=True, cwd=ROOT, timeout=60,
            )  # fmt: skip
        ready_tools = await body_of(f"http://127.0.0.1:{calculator[1]}/readyz")
        # the docs' raw-AMQP publisher (pika, nothing of loopwire's) runs as the publisher
        (tmp_path / "publish.py").write_text(recipe("### A whole publisher with pika"))
        scripted_model.expect(Reply.text("Answered over pika."))
        env = {**os.environ, "LOOPWIRE_AMQP_URL": roles.amqp("loopwire-publisher")}
        published = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "publish.py", "support", "hi"],
            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
        )  # fmt: skip
    assert result.content == "It is 42." and result.steps == 2
    assert published.returncode == 0, published.stderr
    assert "answer (stop): Answered over pika." in published.stdout
    assert "turn.started" in published.stdout  # its events came on its own queue
    assert cli.returncode == 0, cli.stderr

    # a tool service's Redis user reaches no session's state or redaction mapping
    session = result.session_id
    tools = Redis.from_url(roles.redis("loopwire-tools"))
    worker_redis = Redis.from_url(roles.redis("loopwire-worker"))
    try:
        assert await worker_redis.exists(keys.session_state(session)) == 1
        for key in (keys.session_state(session), keys.redaction_map(session)):
            with pytest.raises(NoPermissionError):
                await tools.hgetall(key)
            with pytest.raises(NoPermissionError):
                await tools.delete(key)
        with pytest.raises(NoPermissionError):
            await tools.flushall()
    finally:
        await tools.aclose()
        await worker_redis.aclose()

    # a publisher may publish requests and bind to the events, nothing else
    connection = await aio_pika.connect(roles.amqp("loopwire-publisher"))
    try:
        channel = await connection.channel(publisher_confirms=True)
        with pytest.raises(ChannelAccessRefused):  # straight into a tool's queue
            await channel.default_exchange.publish(
                aio_pika.Message(b"{}"), routing_key=t.tool_queue("calculate")
            )
        channel = await connection.channel()
        with pytest.raises(ChannelAccessRefused):  # the work queue, taken as its own
            await channel.declare_queue(t.TURNS_QUEUE, durable=True, arguments=TURNS_ARGUMENTS)
        channel = await connection.channel()
        dead = await channel.declare_queue(t.DEAD_LETTER_QUEUE, passive=True)
        with pytest.raises(ChannelAccessRefused):  # nor read the dead letters
            await dead.get(fail=False)
    finally:
        await connection.close()

    # no password anywhere a person reads
    seen = "\n".join(
        [
            worker.log_path.read_text(errors="replace"),
            calculator[0].read_text(errors="replace"),
            ready,
            ready_tools,
            cli.stdout + cli.stderr,
            refused_cli.stdout + refused_cli.stderr,
        ]
    )
    assert refused_cli.returncode != 0 and "cannot reach RabbitMQ" in refused_cli.stderr
    for role, password in roles.passwords.items():
        assert password not in seen, f"the {role} password was shown"
