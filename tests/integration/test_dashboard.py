"""The shipped dashboard and alerts, exercised: a real Prometheus, with the shipped
``deploy/prometheus/prometheus.yml`` (its targets pointed at this test's ports) and alert
rules, scrapes a worker, the calculator service and RabbitMQ's plugin while turns run — one
answered, one with a tool error, one failed, one dead-lettered, one duplicate — and then every
expression of the Grafana dashboard evaluates through Prometheus's HTTP API and returns
series."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from redis.asyncio import Redis
from support_rpc import wait_announced

from contracts.client import LoopwireClient
from harness import WorkerProcess, duplicate_and_garbage, free_port, write_agents
from worker.testing.replies import Reply
from worker.testing.scripted_model import ScriptedModel

pytestmark = pytest.mark.timeout(180)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RABBITMQ_METRICS = "127.0.0.1:15692"


def prometheus_config(tmp_path: Path, worker: int, tools: int) -> Path:
    """The shipped configuration, scraping every second, its targets this test's."""
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(DEPLOY / "prometheus" / f) for f in config["rule_files"]]
    targets = {
        "loopwire-worker": [f"127.0.0.1:{worker}"],
        "loopwire-tools": [f"127.0.0.1:{tools}"],
        "rabbitmq": [RABBITMQ_METRICS],
        "rabbitmq-queues": [RABBITMQ_METRICS],
    }
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == set(targets), f"the shipped jobs changed: {sorted(jobs)}"
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def dashboard_queries() -> list[str]:
    board = json.loads((DEPLOY / "grafana/dashboards/loopwire.json").read_text())
    return [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]


def as_promql(expr: str) -> str:
    """Grafana's variables as Grafana fills them in: every agent, a rate window."""
    return expr.replace("$__rate_interval", "30s").replace("$agent", ".*")


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not in time: {what}")
        await asyncio.sleep(0.25)


async def test_every_dashboard_query_returns_series_from_a_real_prometheus(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    redis: Redis,
    spawn: Callable[..., Awaitable[Any]],
    uid: str,
    tmp_path: Path,
) -> None:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (scripts/lib.sh installs Debian's package)"
    tools_port = free_port()
    calculator = await spawn(
        "tool_services.calculator",
        tool="calculate",
        env={"LOOPWIRE_TOOLS__HTTP_PORT": str(tools_port)},
    )
    agents = write_agents(tmp_path / "agents.json", ["calculate"])
    worker = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    web = free_port()
    prometheus: subprocess.Popen[bytes] | None = None
    api = f"http://127.0.0.1:{web}/api/v1"
    session = f"s-{uid}"
    try:
        await wait_announced(redis, "calculator")
        await worker.start()
        config = prometheus_config(tmp_path, worker.port, tools_port)
        with (tmp_path / "prometheus.log").open("wb") as log:
            prometheus = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{web}",
                ],
                stdout=log,
                stderr=log,
            )
        async with aiohttp.ClientSession() as http:

            async def query(expr: str) -> dict[str, Any]:
                async with http.get(f"{api}/query", params={"query": expr}) as response:
                    return dict(await response.json())

            async def all_up() -> bool:
                try:
                    found = await query("up")
                except aiohttp.ClientError:
                    return False
                series = found.get("data", {}).get("result", [])
                return len(series) == 4 and all(s["value"][1] == "1" for s in series)

            await until(all_up, "Prometheus scraping the worker, the service and RabbitMQ")

            scripted_model.expect(Reply.tool_calls(("calculate", {"expression": "6*7"})))
            scripted_model.expect(Reply.text("42"))
            scripted_model.expect(Reply.tool_calls(("calculate", {"expression": "1/0"})))
            scripted_model.expect(Reply.text("cannot divide by zero"))
            scripted_model.expect(Reply.error(500))
            handle = await client.start_turn("support", "6*7?", session_id=session)
            answered = await handle.result(30)
            tool_error = await client.run_turn("support", "1/0?", session_id=session, timeout=30)
            failed = await client.run_turn("support", "again", session_id=session, timeout=30)
            await duplicate_and_garbage(client, handle)

            async def seen(expr: str) -> bool:
                return bool((await query(expr))["data"]["result"])

            await until(
                lambda: seen('loopwire_dead_lettered_total{reason="malformed"} > 0'),
                "the dead letter scraped",
            )
            await until(
                lambda: seen('loopwire_work_dropped_total{reason="duplicate_request"} > 0'),
                "the duplicate scraped",
            )
            await asyncio.sleep(3)  # a few more scrapes: every rate has its samples

            empty: list[str] = []
            for expr in dashboard_queries():
                found = await query(as_promql(expr))
                assert found["status"] == "success", f"{expr}: {found}"
                if not found["data"]["result"]:
                    empty.append(expr)
            assert empty == [], f"dashboard queries without series: {empty}"

            # what the turns did is what Prometheus saw
            assert await seen('loopwire_turns_finished_total{finish_reason="error"} == 1')
            assert await seen('loopwire_turns_finished_total{finish_reason="stop"} == 2')
            assert await seen(
                'loopwire_tool_call_duration_seconds_count{tool="calculate",outcome="error"} == 1'
            )
            assert await seen(
                'loopwire_tool_service_call_duration_seconds_count{tool="calculate",outcome="ok"} == 1'
            )
            assert await seen('loopwire_model_errors_total{error_type="model_http_500"} == 1')
            # the shipped alert rules load in a real Prometheus too
            async with http.get(f"{api}/rules") as response:
                rules = await response.json()
            names = {r["name"] for g in rules["data"]["groups"] for r in g["rules"]}
            assert {"LoopwireTurnsFailing", "LoopwireStepsStuck", "LoopwireModelErrors"} <= names
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(20)
        worker.close()
        calculator.signal(signal.SIGTERM)
        await calculator.wait()
    assert (answered.finish_reason, tool_error.finish_reason, failed.finish_reason) == (
        "stop",
        "stop",
        "error",
    )
    assert worker.errors() == []
