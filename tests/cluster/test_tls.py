"""TLS end to end, against listeners this suite starts (``tls_servers``): a turn with a tool
step runs over ``amqps://`` and ``rediss://`` (both servers require a client certificate) with
the worker, the calculator tool service and the client given the CA and client certificate as
users give them (``LOOPWIRE_*_TLS__*``; the client: ``TlsFiles``), and the ``loopwire``
command reads the same variables. A worker given the wrong CA exits non-zero saying the
certificate could not be verified at which address, for RabbitMQ and for Redis, and no
password shows anywhere."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from contracts.client import LoopwireClient, new_id
from contracts.registry import live_tools
from contracts.runtime.redis_client import redis_client
from contracts.runtime.tls import TlsFiles
from tests.cluster.tls_servers import Pki, TlsRabbit, TlsRedis, pki, tls_rabbit, tls_redis
from tests.integration.harness import WorkerProcess
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
__all__ = ["pki", "tls_rabbit", "tls_redis"]  # the fixtures

ROOT = Path(__file__).resolve().parents[2]


def tls_env(amqp: TlsFiles, redis: TlsFiles) -> dict[str, str]:
    """The variables a user sets (the paths of the files)."""
    env = {}
    for prefix, files in (("LOOPWIRE_AMQP_TLS__", amqp), ("LOOPWIRE_REDIS_TLS__", redis)):
        for field in ("ca_file", "cert_file", "key_file"):
            value = getattr(files, field)
            if value is not None:
                env[prefix + field.upper()] = str(value)
    return env


@pytest.fixture
async def calculator(
    pki: Pki, tls_rabbit: TlsRabbit, tls_redis: TlsRedis, tmp_path: Path
) -> AsyncIterator[Path]:
    log = tmp_path / "calculator.log"
    env = {
        **os.environ,
        "LOOPWIRE_AMQP_URL": tls_rabbit.url(),
        "LOOPWIRE_REDIS_URL": tls_redis.url(),
        **tls_env(pki.client, pki.client),
    }
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "tool_services.calculator"],
            env=env, cwd=ROOT, stdout=sink, stderr=sink,
        )  # fmt: skip
    try:
        yield log
    finally:
        process.terminate()
        process.wait(30)


async def announced(url: str, tls: TlsFiles, tool: str, timeout: float = 30) -> None:
    """Wait until ``tool`` is offered (its service announced it in Redis, over TLS)."""
    redis = redis_client(url, tls=tls)
    try:
        deadline = time.monotonic() + timeout
        while tool not in await live_tools(redis):
            assert time.monotonic() < deadline, f"{tool} was never announced"
            await asyncio.sleep(0.2)
    finally:
        await redis.aclose()


def agents_file(tmp_path: Path) -> Path:
    agents = tmp_path / "agents.json"
    agents.write_text(json.dumps({"agents": [{"name": "support", "tools": ["calculate"]}]}))
    return agents


async def test_a_turn_with_a_tool_step_runs_over_tls(
    pki: Pki,
    tls_rabbit: TlsRabbit,
    tls_redis: TlsRedis,
    calculator: Path,
    scripted_model: ScriptedModel,
    tmp_path: Path,
) -> None:
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents_file(tmp_path),
        redis_url=tls_redis.url(),
        extra_env={"LOOPWIRE_AMQP_URL": tls_rabbit.url(), **tls_env(pki.client, pki.client)},
    )
    async with worker:
        await announced(tls_redis.url(), pki.client, "calculate")
        scripted_model.expect(Reply.tool_calls(("calculate", {"expression": "6*7"})))
        scripted_model.expect(Reply.text("It is 42."), check=lambda body: "42" in json.dumps(body))
        async with LoopwireClient(tls_rabbit.url(), tls=pki.client) as client:
            result = await client.run_turn("support", "6 times 7?", session_id=new_id(), timeout=30)
        assert result.content == "It is 42." and result.steps == 2, result

        # the command line reads the same variables
        cli = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "worker.cli", "--amqp-url", tls_rabbit.url(),
             "result", result.turn_id, "--json"],
            env={**os.environ, **tls_env(pki.client, pki.client)},
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["result"]["content"] == "It is 42."

    # the URL query forms the libraries read work too (aiormq's; redis-py's, one Redis)
    client_files = pki.client
    query = (
        f"?cafile={client_files.ca_file}&certfile={client_files.cert_file}"
        f"&keyfile={client_files.key_file}"
    )
    async with LoopwireClient(tls_rabbit.url() + query) as client:
        assert client.requests.name
    by_query = redis_client(
        tls_redis.url() + f"?ssl_ca_certs={client_files.ca_file}"
        f"&ssl_certfile={client_files.cert_file}&ssl_keyfile={client_files.key_file}"
    )
    try:
        assert await by_query.ping()
    finally:
        await by_query.aclose()

    logs = [worker.log_path, calculator]
    seen = "".join(path.read_text(errors="replace") for path in logs) + cli.stdout + cli.stderr
    for password in (tls_rabbit.password, tls_redis.password):
        assert password not in seen


@pytest.mark.parametrize("server", ["rabbitmq", "redis"])
async def test_a_worker_given_the_wrong_ca_refuses_to_connect(
    server: str,
    pki: Pki,
    tls_rabbit: TlsRabbit,
    tls_redis: TlsRedis,
    scripted_model: ScriptedModel,
    tmp_path: Path,
) -> None:
    amqp, redis = (pki.wrong_ca, pki.client) if server == "rabbitmq" else (pki.client, pki.wrong_ca)
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=agents_file(tmp_path),
        redis_url=tls_redis.url(),
        extra_env={"LOOPWIRE_AMQP_URL": tls_rabbit.url(), **tls_env(amqp, redis)},
    )
    try:
        with pytest.raises(RuntimeError, match="worker exited"):
            await worker.start(timeout=60)
        code = await worker.exited()
    finally:
        worker.close()
    log = worker.log_path.read_text(errors="replace")
    assert code != 0
    where = (
        f"cannot reach RabbitMQ at localhost:{tls_rabbit.tls_port}/"
        if server == "rabbitmq"
        else f"cannot reach Redis at 127.0.0.1:{tls_redis.port}"
    )
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert any(where in line and "certificate could not be verified" in line for line in errors), (
        log
    )
    assert tls_rabbit.password not in log and tls_redis.password not in log
