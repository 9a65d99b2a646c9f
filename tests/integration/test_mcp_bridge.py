"""The MCP bridge end to end: bridge processes (``python -m tool_services.mcp``) serving an MCP
server written with the ``mcp`` SDK (``tests.mcp_fixtures.server``, over stdio and over
Streamable HTTP) and the published reference server ``mcp-server-time``, called by a real
worker driven by the scripted model (a bridge killed mid-call too), and by the raw RPC caller
for the other faults."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from support_rpc import RpcCaller, wait_announced, wait_until

from contracts.client import LoopwireClient
from contracts.registry import live_tools
from contracts.topology import tool_queue
from harness import WorkerProcess, free_port, write_agents
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FIXTURE = ["-m", "tests.mcp_fixtures.server"]
FAST = {  # restart at once and notice a dead session within a second
    "LOOPWIRE_MCP__HEALTH_INTERVAL_S": "0.5",
    "LOOPWIRE_MCP__RESTART_MIN_S": "0.2",
    "LOOPWIRE_MCP__RESTART_MAX_S": "1",
}


def stdio_fixture(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "stdio": {
            "command": sys.executable,
            "args": [*FIXTURE, "stdio"],
            "cwd": str(REPO),
            "env": ["PYTHONPATH", "MCP_FIXTURE_LOG"],
        },
        **extra,
    }


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def has_line(path: Path, prefix: str, count: int = 1) -> Callable[[], bool]:
    return lambda: sum(line.startswith(prefix) for line in lines(path)) >= count


async def offered(redis: Redis, *names: str) -> bool:
    tools = await live_tools(redis)
    return all(name in tools for name in names)


@pytest.fixture
async def http_fixture(tmp_path: Path) -> AsyncIterator[str]:
    """The fixture server on Streamable HTTP; its URL once it accepts connections."""
    port = free_port()
    log = (tmp_path / "http-server.log").open("wb")
    env = {**os.environ, "PYTHONPATH": str(REPO), "MCP_FIXTURE_LOG": str(tmp_path / "calls.log")}
    process = subprocess.Popen(
        [sys.executable, *FIXTURE, "http", str(port)], cwd=REPO, env=env, stdout=log, stderr=log
    )

    async def accepting() -> bool:
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return True
        return False

    try:
        await wait_until(accepting, timeout=20)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.kill()
        process.wait(10)
        log.close()


@pytest.fixture
def bridge(spawn: Any, queues: list[str], tmp_path: Path, uid: str) -> Callable[..., Any]:
    """``await bridge(config, tools)``: a bridge process serving ``config``; ``tools`` are
    the tool names it will serve (their queues are deleted at the end)."""

    async def start(config: dict[str, Any], tools: list[str], **env: str) -> Any:
        path = tmp_path / f"mcp-{uid}-{len(queues)}.json"
        path.write_text(json.dumps(config))
        queues.extend(tool_queue(name) for name in tools[1:])
        return await spawn(
            "tool_services.mcp",
            tool=tools[0],
            env={
                "LOOPWIRE_MCP__CONFIG": str(path),
                "LOOPWIRE_MCP__SERVICE": f"mcp-{uid}",
                "PYTHONPATH": str(REPO),
                "MCP_FIXTURE_LOG": str(tmp_path / "calls.log"),
                **FAST,
                **env,
            },
        )

    return start


def tool_results(request: dict[str, Any]) -> dict[str, str]:
    """Tool call id → the content the model was shown."""
    return {m["tool_call_id"]: m["content"] for m in request["messages"] if m["role"] == "tool"}


async def test_the_model_calls_mcp_tools_over_stdio_http_and_a_published_server(
    topology: None,
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    bridge: Any,
    http_fixture: str,
    redis: Redis,
    tmp_path: Path,
    uid: str,
) -> None:
    s, h, t = f"s{uid}", f"h{uid}", f"t{uid}"
    config = {
        "servers": [
            stdio_fixture("stdio", prefix=s, deny=["grow"]),
            {
                "name": "http",
                "prefix": h,
                "http": {"url": http_fixture},
                "allow": ["add", "fail", "slow", "grow", "extra"],
                "tools": {"slow": {"timeout_s": 0.5}},
            },
            {
                "name": "time",
                "prefix": t,
                "stdio": {
                    "command": sys.executable,
                    "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"],
                },
                "idempotent": True,
            },
        ]
    }
    names = [f"{s}_add", f"{s}_picture", f"{h}_fail", f"{h}_slow", f"{h}_grow"]
    names += [f"{t}_get_current_time", f"{h}_extra"]
    process = await bridge(config, names)
    await wait_until(lambda: offered(redis, *names[:-1]), timeout=30)
    tools = await live_tools(redis)
    assert f"{s}_grow" not in tools and f"{h}_echo" not in tools  # deny and allow lists
    assert tools[f"{s}_add"].parameters["properties"]["terms"]["type"] == "array"
    assert tools[f"{s}_add"].description == "Add integers; a structured result."
    assert tools[f"{t}_get_current_time"].idempotent

    scripted_model.expect(
        Reply.tool_calls(
            (f"{s}_add", {"terms": [2, 3]}, "c_add"),
            (f"{s}_picture", {}, "c_pic"),
            (f"{h}_fail", {"message": "out of stock"}, "c_fail"),
            (f"{h}_slow", {"seconds": 20, "tag": "w"}, "c_slow"),
            (f"{t}_get_current_time", {"timezone": "UTC"}, "c_time"),
            (f"{h}_grow", {}, "c_grow"),
        )
    )
    scripted_model.expect(Reply.text("done"))
    agents = write_agents(tmp_path / "agents.json", names)
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker:
        result = await client.run_turn("support", "go", timeout=60)
        assert result.content == "done", worker.stderr()
        offered_first = {f["function"]["name"] for f in scripted_model.requests[0]["tools"]}
        assert set(names[:-1]) <= offered_first
        shown = tool_results(scripted_model.requests[1])
        assert json.loads(shown["c_add"]) == {"total": 5, "terms": [2, 3]}
        assert "[image: image/png" in shown["c_pic"]
        assert "out of stock" in shown["c_fail"] and "error" in shown["c_fail"]
        # the worker's deadline for the call (its 0.5 s budget) became the MCP request's
        assert "deadline passed after 0." in shown["c_slow"] or "timed out" in shown["c_slow"]
        assert "datetime" in shown["c_time"] and "UTC" in shown["c_time"]
        # the tool list changed at run time: the new tool is announced and offered
        await wait_until(lambda: offered(redis, f"{h}_extra"), timeout=15)
        scripted_model.expect(Reply.tool_calls((f"{h}_extra", {}, "c_extra")))
        scripted_model.expect(Reply.text("extra done"))
        again = await client.run_turn("support", "more", session_id=result.session_id, timeout=60)
        assert again.content == "extra done", worker.stderr()
        assert json.loads(tool_results(scripted_model.requests[3])["c_extra"]) == {
            "result": "extra ran"
        }
    await wait_until(has_line(tmp_path / "calls.log", "cancelled slow w"))  # MCP cancellation
    process.signal(signal.SIGTERM)
    assert await process.wait() == 0, process.output()


async def test_two_bridges_and_one_sigkilled_mid_call(
    bridge: Any, caller: RpcCaller, redis: Redis, tmp_path: Path, uid: str
) -> None:
    once, again = f"o{uid}", f"a{uid}"  # the same server: not idempotent, and idempotent
    config = {
        "servers": [
            stdio_fixture("once", prefix=once),
            stdio_fixture("again", prefix=again, tools={"slow": {"idempotent": True}}),
        ]
    }
    names = [f"{once}_slow", f"{again}_slow", f"{once}_echo"]
    first = await bridge(config, names)
    first_id = await wait_announced(redis, f"mcp-{uid}")
    log = tmp_path / "calls.log"
    risky = caller.request(
        f"{once}_slow", {"seconds": 30, "tag": "r"}, turn_id=f"t-{uid}", deadline_s=60
    )
    retried = caller.request(
        f"{again}_slow", {"seconds": 6, "tag": "i"}, turn_id=f"t-{uid}", deadline_s=60
    )
    sent_risky, sent_retried = await caller.send(risky), await caller.send(retried)
    await wait_until(has_line(log, "start slow r"))
    await wait_until(has_line(log, "start slow i"))

    second = await bridge(config, names)  # its own sessions, its own child processes
    await wait_announced(redis, f"mcp-{uid}", exclude={first_id})
    first.signal(signal.SIGKILL)
    assert await first.wait() == -signal.SIGKILL

    # The broker hands both calls to the second bridge once the first one's lease lapsed.
    reply = await caller.wait_reply(sent_risky, timeout=30)
    assert reply.status == "unknown", second.output()
    assert reply.error is not None and "may or may not have taken effect" in reply.error
    reply = await caller.wait_reply(sent_retried, timeout=30)
    assert (reply.status, reply.value) == ("ok", {"result": "slept 6.0s"}), second.output()
    assert sum(line.startswith("start slow r") for line in lines(log)) == 1
    assert sum(line.startswith("start slow i") for line in lines(log)) == 2
    # a redelivered call that already ran is answered from the store
    stored = await caller.call(retried, correlation_id=f"{retried.call_id}-dup")
    assert stored.value == {"result": "slept 6.0s"}
    assert sum(line.startswith("start slow i") for line in lines(log)) == 2
    # the survivor still serves
    echo = await caller.call(caller.request(f"{once}_echo", {"text": "hi"}, turn_id=f"t-{uid}"))
    assert (echo.status, echo.value) == ("ok", {"result": "hi"})
    second.signal(signal.SIGTERM)
    assert await second.wait() == 0, second.output()


async def test_a_server_killed_mid_call_is_withdrawn_restarted_and_offered_again(
    bridge: Any, caller: RpcCaller, redis: Redis, tmp_path: Path, uid: str
) -> None:
    prefix, refuse = f"k{uid}", tmp_path / "refuse"
    server = stdio_fixture("killed", prefix=prefix)
    server["stdio"]["env"].append("MCP_FIXTURE_REFUSE_FILE")
    names = [f"{prefix}_slow", f"{prefix}_echo"]
    process = await bridge({"servers": [server]}, names, MCP_FIXTURE_REFUSE_FILE=str(refuse))
    await wait_until(lambda: offered(redis, *names), timeout=30)
    log = tmp_path / "calls.log"
    call = caller.request(names[0], {"seconds": 30, "tag": "x"}, turn_id=f"t-{uid}", deadline_s=60)
    sent = await caller.send(call)
    await wait_until(has_line(log, "start slow x"))
    pid = int(next(line for line in lines(log) if line.startswith("start slow x")).split()[-1])
    refuse.touch()  # it cannot start again until the file goes
    os.kill(pid, signal.SIGKILL)

    reply = await caller.wait_reply(sent, timeout=20)
    assert reply.status == "unknown", process.output()
    assert reply.error is not None and "went away during the call" in reply.error

    async def withdrawn() -> bool:
        tools = await live_tools(redis)
        return not any(name in tools for name in names)

    await wait_until(withdrawn, timeout=15)
    echo = caller.request(names[1], {"text": "hi"}, turn_id=f"t-{uid}")
    reply = await caller.call(echo)
    assert (reply.status, reply.error) == (
        "error",
        "tool unavailable: the MCP server 'killed' is not connected",
    )
    refuse.unlink()
    await wait_until(lambda: offered(redis, *names), timeout=15)
    reply = await caller.call(caller.request(names[1], {"text": "back"}, turn_id=f"t-{uid}"))
    assert (reply.status, reply.value) == ("ok", {"result": "back"}), process.output()
    assert "MCP server killed: starting again" in process.output()
    process.signal(signal.SIGTERM)
    assert await process.wait() == 0, process.output()


async def test_a_bridge_killed_mid_call_tells_the_model_through_a_worker(
    topology: None,
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    bridge: Any,
    redis: Redis,
    tmp_path: Path,
    uid: str,
) -> None:
    """The turn's call of a tool not marked idempotent is out when its bridge is SIGKILLed:
    another bridge takes the redelivered call and, not running it again, answers that its
    outcome is unknown; the model is told so, and the turn goes on to its answer."""
    once = f"w{uid}"
    config = {"servers": [stdio_fixture("once", prefix=once)]}
    names = [f"{once}_slow", f"{once}_echo"]
    first = await bridge(config, names)
    first_id = await wait_announced(redis, f"mcp-{uid}")
    log = tmp_path / "calls.log"
    scripted_model.expect(Reply.tool_calls((names[0], {"seconds": 30, "tag": "k"}, "c_kill")))
    scripted_model.expect(Reply.text("I could not tell whether it ran."))
    agents = write_agents(tmp_path / "agents.json", names, tool_timeout_s=60)
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker:
        handle = await client.start_turn("support", "run it once")
        await wait_until(has_line(log, "start slow k"), timeout=30)
        second = await bridge(config, names)
        await wait_announced(redis, f"mcp-{uid}", exclude={first_id})
        first.signal(signal.SIGKILL)
        assert await first.wait() == -signal.SIGKILL
        result = await handle.result(60)
        await handle.close()
        assert worker.errors() == []
    assert (result.finish_reason, result.content) == ("stop", "I could not tell whether it ran.")
    told = tool_results(scripted_model.requests[1])["c_kill"]
    assert "may or may not have taken effect" in json.loads(told)["error"]
    assert sum(line.startswith("start slow k") for line in lines(log)) == 1  # never run twice
    second.signal(signal.SIGTERM)
    assert await second.wait() == 0, second.output()


async def test_a_server_killed_mid_call_tells_the_model_through_a_worker(
    topology: None,
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    bridge: Any,
    redis: Redis,
    tmp_path: Path,
    uid: str,
) -> None:
    """The MCP server itself dies while a turn's call runs in it: the bridge answers that the
    call's outcome is unknown, the model is told so through the worker, and the turn goes on
    to its answer; the server is started again and its tools offered again."""
    prefix = f"m{uid}"
    names = [f"{prefix}_slow", f"{prefix}_echo"]
    process = await bridge({"servers": [stdio_fixture("dies", prefix=prefix)]}, names)
    await wait_until(lambda: offered(redis, *names), timeout=30)
    log = tmp_path / "calls.log"
    scripted_model.expect(Reply.tool_calls((names[0], {"seconds": 30, "tag": "d"}, "c_dies")))
    scripted_model.expect(Reply.text("The server went away; I do not know if it ran."))
    agents = write_agents(tmp_path / "agents.json", names, tool_timeout_s=60)
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker:
        handle = await client.start_turn("support", "run it")
        await wait_until(has_line(log, "start slow d"), timeout=30)
        pid = int(next(line for line in lines(log) if line.startswith("start slow d")).split()[-1])
        os.kill(pid, signal.SIGKILL)
        result = await handle.result(60)
        await handle.close()
        assert worker.errors() == []
    assert result.finish_reason == "stop", process.output()
    told = json.loads(tool_results(scripted_model.requests[1])["c_dies"])["error"]
    assert "went away during the call" in told
    await wait_until(lambda: offered(redis, *names), timeout=30)  # started again
    assert "MCP server dies: starting again" in process.output()
    process.signal(signal.SIGTERM)
    assert await process.wait() == 0, process.output()
