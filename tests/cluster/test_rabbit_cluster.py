"""loopwire on a real three-node RabbitMQ cluster loses the node a worker is connected to.

Fifty turns, each with two tool steps, run over two worker processes and a tool service
(``ToolServer``, in this process), every one of them given the three nodes' addresses. While
the turns run, the node the first worker is connected to (its metric says which) is stopped
(``rabbitmqctl stop_app``) and later started again. The worker and the tool service, both
connected to it, fail over to another node. Every turn ends once with its own answer, no tool
call runs twice, and the worker says that it reconnected, in its log and its metrics, without
ever logging the password. And the ``loopwire`` command, given the three addresses, goes
through a node that is up when the first is down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel
from redis.asyncio import Redis
from yarl import URL

from contracts.client import LoopwireClient, TurnHandle
from contracts.turns import TurnResult
from tests.cluster.rabbit_cluster import RabbitCluster, rabbit_cluster
from tests.integration.harness import (
    REDIS_URL,
    EventRecorder,
    WorkerProcess,
    run_cli,
    write_agents,
)
from tests.integration.nodes import RabbitNode
from tool_services.sdk import CallContext, ToolService
from tool_services.server import ToolServer
from tool_services.settings import Settings, ToolServiceSettings
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
__all__ = ["rabbit_cluster"]  # the module-scoped fixture, used from here

TURNS = 45
"""Turns published one by one through a client on a node that stays up."""
SLOW_TURNS = 5
"""Turns published through a client on the node that goes down, just before it goes: their
model calls are slow, so they are still running when it does."""
TOOL_STEPS = 2
STOP_AFTER = 12
"""Turns published before the node goes down."""


class CountArgs(BaseModel):
    q: str


def counting_service(tool: str, runs: Counter[str]) -> ToolService:
    """A tool that counts its executions per idempotency key."""
    service = ToolService(tool)

    async def count(args: CountArgs, ctx: CallContext) -> dict[str, str]:
        runs[ctx.idempotency_key] += 1
        await asyncio.sleep(0.05)
        return {"counted": args.q}

    service.add_tool(
        count, name=tool, description="count", timeout_s=30, idempotent=False, args_model=CountArgs
    )
    return service


def two_tool_steps(tool: str) -> Callable[[dict[str, Any]], Reply]:
    """Two tool calls, then an answer naming the turn's input."""

    def responder(body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        text = messages[last_user]["content"]
        done = sum(1 for m in messages[last_user:] if m["role"] == "tool")
        delay = 2.0 if text.startswith("slow") else 0.1
        if done < TOOL_STEPS:
            return Reply.tool_calls((tool, {"q": f"{text}#{done}"}), delay=delay)
        return Reply.text(f"done {text}", delay=delay)

    return responder


async def metrics_of(worker: WorkerProcess) -> dict[tuple[str, str], float]:
    """(sample name, its ``address`` label) -> value, summed over the other labels, of the
    worker's ``/metrics``."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{worker.port}/metrics") as response,
    ):
        text = await response.text()
    samples: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("address", ""))
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


STEPS = ("loopwire_step_duration_seconds_count", "")


def connected_port(samples: dict[tuple[str, str], float]) -> int | None:
    up = [addr for (name, addr), v in samples.items() if name == "loopwire_amqp_connected" and v]
    return int(up[0].split("/")[0].rsplit(":", 1)[1]) if len(up) == 1 else None


def reorder(urls: list[str], first: int) -> list[str]:
    return urls[first:] + urls[:first]


@pytest.fixture
async def uid() -> AsyncIterator[str]:
    uid = uuid.uuid4().hex[:10]
    yield uid
    redis = Redis.from_url(REDIS_URL)
    try:
        for pattern in (f"lw:toolcall:{{t-{uid}*", f"lw:{{s-{uid}*", f"lw:turn:t-{uid}*"):
            async for key in redis.scan_iter(match=pattern):
                await redis.delete(key)
    finally:
        await redis.aclose()


async def test_turns_survive_losing_the_node_a_worker_is_connected_to(
    rabbit_cluster: RabbitCluster,
    scripted_model: ScriptedModel,
    uid: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    cluster = rabbit_cluster
    urls = cluster.urls
    tool = f"count_{uid}"
    runs: Counter[str] = Counter()
    scripted_model.respond_with(two_tool_steps(tool))
    agents = write_agents(tmp_path / "agents.json", [tool])

    def worker(order: list[str]) -> WorkerProcess:
        return WorkerProcess(
            model_url=scripted_model.base_url,
            agents_file=agents,
            extra_env={
                "LOOPWIRE_AMQP_URL": order[0],
                "LOOPWIRE_AMQP_URLS": ",".join(order),
                "LOOPWIRE_RECONNECT_INTERVAL_S": "0.5",
            },
        )

    first, second = worker(urls), worker(reorder(urls, 1))
    server = ToolServer(
        counting_service(tool, runs),
        Settings(
            amqp_url=urls[0],
            amqp_urls=",".join(urls),
            redis_url=REDIS_URL,
            tools=ToolServiceSettings(reconnect_interval_s=0.5),
        ),
    )
    recorder = EventRecorder("#", amqp_urls=reorder(urls, 2))  # the cluster is this test's
    far = LoopwireClient(reorder(urls, 2), reconnect_s=0.5)
    near = LoopwireClient(urls, reconnect_s=0.5)  # on the node that goes down
    handles: list[TurnHandle] = []
    slow: list[TurnHandle] = []
    down: list[RabbitNode] = []
    try:
        await first.start(timeout=60)
        await second.start(timeout=60)
        await server.start()
        await recorder.start()
        await far.connect()
        await near.connect()

        # every queue loopwire declares has a member on each node; reply queues are exclusive
        listed = await asyncio.to_thread(
            cluster.nodes[1].ctl,
            *("list_queues", "name", "type", "exclusive", "members", "--formatter", "json"),
        )
        queues = json.loads(listed)
        shared = {q["name"]: q for q in queues if not q["exclusive"]}
        assert {"loopwire.turns", "loopwire.sessions", f"loopwire.tool.{tool}"} <= set(shared)
        assert {name: q["type"] for name, q in shared.items()} == dict.fromkeys(shared, "quorum")
        assert {name: len(q["members"]) for name, q in shared.items()} == dict.fromkeys(shared, 3)
        replies = [q["name"] for q in queues if q["exclusive"]]
        assert any(name.startswith("loopwire.replies.") for name in replies)

        port = connected_port(await metrics_of(first))
        assert port == URL(urls[0]).port, "the worker starts on the first address it is given"
        doomed = cluster.node_of(port)
        half_way = asyncio.Event()

        async def publish() -> None:
            for i in range(TURNS):
                handles.append(
                    await far.start_turn(
                        "support",
                        f"turn {i}",
                        turn_id=f"t-{uid}-{i:02d}",
                        session_id=f"s-{uid}-{i:02d}",
                    )
                )
                if i + 1 == STOP_AFTER:
                    half_way.set()
                await asyncio.sleep(0.2)

        async def outage() -> tuple[float, float]:
            await half_way.wait()
            for j in range(SLOW_TURNS):
                slow.append(
                    await near.start_turn(
                        "support",
                        f"slow turn {j}",
                        turn_id=f"t-{uid}-s{j}",
                        session_id=f"s-{uid}-s{j}",
                    )
                )
            down.append(doomed)
            await asyncio.to_thread(doomed.stop_app)
            stopped = time.monotonic()
            assert not any(h.done for h in slow), "the slow turns ended before the node went"
            deadline = stopped + 30
            while time.monotonic() < deadline:
                samples = await metrics_of(first)
                moved = connected_port(samples)
                if moved is not None and moved != port:
                    break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError("the worker did not reconnect to another node")
            failed_over = time.monotonic() - stopped
            await asyncio.sleep(3)  # turns keep running on two nodes
            await asyncio.to_thread(doomed.start_app)
            down.remove(doomed)
            return failed_over, samples[STEPS]

        async with asyncio.TaskGroup() as group:
            group.create_task(publish())
            outaged = group.create_task(outage())
        failed_over_s, steps_at_failover = outaged.result()
        results: list[TurnResult] = [await h.result(180) for h in handles + slow]
        await recorder.wait_for(
            lambda events: (
                len({e.turn_id for e in events if e.type == "turn.completed"}) >= TURNS + SLOW_TURNS
            ),
            timeout=60,
        )
        await asyncio.sleep(1)  # a late duplicate would show up now
        samples = await metrics_of(first)
        service_reconnects = server.metrics.registry.get_sample_value(
            "loopwire_amqp_reconnects_total"
        )
    finally:
        first.close()
        second.close()
        for node in down:  # a failed test leaves no node down: the others could not close
            await asyncio.to_thread(node.start_app)
        async with asyncio.timeout(60):
            await far.close()
            await near.close()
            await recorder.stop()
            await server.stop()

    # every turn ends once, with its own answer; the client on the lost node gets its answers
    texts = [f"turn {i}" for i in range(TURNS)] + [f"slow turn {j}" for j in range(SLOW_TURNS)]
    ids = [f"t-{uid}-{i:02d}" for i in range(TURNS)] + [f"t-{uid}-s{j}" for j in range(SLOW_TURNS)]
    assert [r.turn_id for r in results] == ids
    assert [(r.finish_reason, r.content) for r in results] == [("stop", f"done {t}") for t in texts]
    finals = Counter(
        (e.turn_id, e.type)
        for e in {e.id: e for e in recorder.events}.values()  # events carry deterministic ids
        if e.type in ("turn.completed", "turn.failed")
    )
    assert finals == Counter({(turn_id, "turn.completed"): 1 for turn_id in ids})
    # no tool call ran twice, and every one ran
    assert len(runs) == len(ids) * TOOL_STEPS
    assert [key for key, n in runs.items() if n != 1] == []

    # the worker says it reconnected (its log and its metrics) and went on taking work; the
    # tool service and the client on the lost node moved too; no password in any log
    log = first.log_path.read_text(errors="replace")
    assert f"lost the broker connection to 127.0.0.1:{port}/" in log
    assert "reconnected to the broker at 127.0.0.1:" in log
    assert samples[("loopwire_amqp_reconnects_total", "")] >= 1
    assert samples[("loopwire_amqp_connected", f"127.0.0.1:{port}/")] == 0
    assert connected_port(samples) not in (None, port)
    assert samples[STEPS] > steps_at_failover, "the worker took no work after it reconnected"
    assert failed_over_s < 15
    assert service_reconnects is not None and service_reconnects >= 1
    assert "loopwire-client: reconnected to the broker at" in caplog.text
    for text in (log, second.log_path.read_text(errors="replace"), caplog.text):
        assert cluster.password not in text


async def test_the_cli_goes_through_a_node_that_is_up(rabbit_cluster: RabbitCluster) -> None:
    """``loopwire`` given the three nodes (``LOOPWIRE_AMQP_URLS``, or ``--amqp-url`` with the
    list) while the first is down: it passes over it and publishes through the next (a cancel
    first asks the workers whether the turn is theirs: with none running here, no worker
    answers, which only a command that got through can hear); with every node down it says
    which addresses it tried, without the password."""
    cluster = rabbit_cluster
    env = {**os.environ, "LOOPWIRE_AMQP_URLS": ",".join(cluster.urls)}
    env.pop("LOOPWIRE_AMQP_URL", None)

    async def loopwire(*args: str) -> subprocess.CompletedProcess[str]:
        return await run_cli(*args, env=env)

    down = cluster.nodes[0]
    await asyncio.to_thread(down.stop_app)
    try:
        by_env, by_flag = await asyncio.gather(  # each waits out the lookup's 30 s
            loopwire("cancel", "t-cli-1", "--reason", "operator"),
            loopwire(
                "--amqp-url", ",".join(cluster.urls), "cancel", "t-cli-2", "--reason", "operator"
            ),
        )
        unreachable = await loopwire(
            "--amqp-url", cluster.urls[0], "cancel", "t-cli-3", "--reason", "operator"
        )
    finally:
        await asyncio.to_thread(down.start_app)
    for out, turn in ((by_env, "t-cli-1"), (by_flag, "t-cli-2")):
        assert (out.returncode, out.stderr) == (
            1,
            f"error: no worker answered the lookup of turn {turn} (is a worker running?)\n",
        ), out.stderr
    assert unreachable.returncode == 1
    assert unreachable.stderr.startswith(
        f"error: cannot reach RabbitMQ at 127.0.0.1:{down.port}/ ("
    )
    for out in (by_env, by_flag, unreachable):
        assert cluster.password not in out.stdout + out.stderr
