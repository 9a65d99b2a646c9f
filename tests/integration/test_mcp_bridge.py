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
import re
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


SERVABLE = ["add", "echo", "fail", "slow", "picture", "getenv", "grow", "extra", "freeze"]
SERVABLE += ["reshape", "get_current_time", "convert_time"]
"""Every tool the test servers may list: their queues (under each prefix) go at the end."""


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


async def withdrawn(redis: Redis, *names: str) -> bool:
    tools = await live_tools(redis)
    return not any(name in tools for name in names)


def restart_delays(output: str, server: str) -> list[float]:
    """The delays the bridge said it waits before each new start of ``server``."""
    found = re.findall(rf"MCP server {server}: starting again in ([0-9.e+-]+)s", output)
    return [float(delay) for delay in found]


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def pid_of(log: Path, prefix: str) -> int:
    return int(next(line for line in lines(log) if line.startswith(prefix)).split()[-1])


class HttpServer:
    """The fixture server on Streamable HTTP, on a port of its own that it keeps across a
    ``stop()`` (SIGKILL) and a ``start()`` again: a server that goes away and comes back."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.tmp_path = tmp_path
        self.process: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        """Start it; back once it accepts connections."""
        log = (self.tmp_path / "http-server.log").open("ab")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env["MCP_FIXTURE_LOG"] = str(self.tmp_path / "calls.log")
        with log:
            self.process = subprocess.Popen(
                [sys.executable, *FIXTURE, "http", str(self.port)],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=log,
            )
        await wait_until(self.accepting, timeout=20)

    async def accepting(self) -> bool:
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", self.port)
            writer.close()
            return True
        return False

    async def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            await asyncio.to_thread(self.process.wait, 10)


@pytest.fixture
async def http_server(tmp_path: Path) -> AsyncIterator[HttpServer]:
    server = HttpServer(tmp_path)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def http_fixture(http_server: HttpServer) -> str:
    """The fixture server on Streamable HTTP; its URL once it accepts connections."""
    return http_server.url


@pytest.fixture
def bridge(spawn: Any, queues: list[str], tmp_path: Path, uid: str) -> Callable[..., Any]:
    """``await bridge(config, tools)``: a bridge process serving ``config``; ``tools`` are
    the tool names it will serve (their queues, and those of every tool its servers may
    list, are deleted at the end)."""

    async def start(config: dict[str, Any], tools: list[str], **env: str) -> Any:
        path = tmp_path / f"mcp-{uid}-{len(queues)}.json"
        path.write_text(json.dumps(config))
        queues.extend(tool_queue(name) for name in tools[1:])
        prefixes = [server["prefix"] for server in config["servers"] if "prefix" in server]
        queues.extend(tool_queue(f"{p}_{tool}") for p in prefixes for tool in SERVABLE)
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


async def test_an_http_server_that_goes_away_is_withdrawn_reconnected_with_backoff_and_back(
    bridge: Any, caller: RpcCaller, redis: Redis, http_server: HttpServer, uid: str
) -> None:
    """An HTTP server killed while idle: the next ping (``HEALTH_INTERVAL_S``, 0.5 s here)
    finds the connection refused, its tools are withdrawn and answer ``tool unavailable``;
    the bridge tries again and again, each time later (0.2 s doubling to 1 s), and once the
    server listens again its tools are announced again and answer."""
    prefix = f"r{uid}"
    names = [f"{prefix}_echo", f"{prefix}_add"]
    server = {"name": "web", "prefix": prefix, "http": {"url": http_server.url}}
    process = await bridge({"servers": [{**server, "allow": ["echo", "add"]}]}, names)
    await wait_until(lambda: offered(redis, *names), timeout=30)
    echo = caller.request(names[0], {"text": "before"}, turn_id=f"t-{uid}")
    reply = await caller.call(echo)
    assert (reply.status, reply.value) == ("ok", {"result": "before"}), process.output()

    await http_server.stop()
    await wait_until(lambda: withdrawn(redis, *names), timeout=10)  # 0.5 s, and the load
    reply = await caller.call(caller.request(names[0], {"text": "away"}, turn_id=f"t-{uid}"))
    assert (reply.status, reply.error) == (
        "error",
        "tool unavailable: the MCP server 'web' is not connected",
    )
    await wait_until(lambda: len(restart_delays(process.output(), "web")) >= 4, timeout=15)

    await http_server.start()
    await wait_until(lambda: offered(redis, *names), timeout=15)
    add = caller.request(names[1], {"terms": [4, 5]}, turn_id=f"t-{uid}")
    reply = await caller.call(add)
    assert (reply.status, reply.value) == ("ok", {"total": 9, "terms": [4, 5]}), process.output()
    assert restart_delays(process.output(), "web")[:4] == [0.2, 0.4, 0.8, 1.0]
    process.signal(signal.SIGTERM)
    assert await process.wait() == 0, process.output()


async def test_a_hung_server_is_found_by_its_ping_and_restarted_while_another_serves(
    bridge: Any, caller: RpcCaller, redis: Redis, tmp_path: Path, uid: str
) -> None:
    """A stdio server whose event loop blocks for good (``freeze``): the process lives, nothing
    is answered. The call that froze it is answered within its own time (1 s); the next ping
    gets no answer within ``PING_TIMEOUT_S`` (4 s here), and the server's tools are withdrawn
    at once, before its process is stopped (which takes the SDK's seconds of grace), then it
    is started again. The other server's tools are served throughout."""
    hung, other, refuse = f"g{uid}", f"v{uid}", tmp_path / "refuse"
    frozen = stdio_fixture("hung", prefix=hung, allow=["freeze", "echo"])
    frozen["stdio"]["env"].append("MCP_FIXTURE_REFUSE_FILE")
    frozen["tools"] = {"freeze": {"timeout_s": 1}}
    names = [f"{hung}_freeze", f"{hung}_echo", f"{other}_echo"]
    config = {"servers": [frozen, stdio_fixture("other", prefix=other, allow=["echo"])]}
    env = {"MCP_FIXTURE_REFUSE_FILE": str(refuse), "LOOPWIRE_MCP__PING_TIMEOUT_S": "4"}
    process = await bridge(config, names, **env)
    await wait_until(lambda: offered(redis, *names), timeout=30)
    refuse.touch()  # the hung one cannot start again until the file goes

    async def echo(tool: str, text: str) -> tuple[str, Any, str | None]:
        reply = await caller.call(caller.request(tool, {"text": text}, turn_id=f"t-{uid}"))
        return reply.status, reply.value, reply.error

    freeze = caller.request(names[0], {}, turn_id=f"t-{uid}", deadline_s=30)
    reply = await caller.call(freeze, timeout=20)
    assert (reply.status, reply.error) == ("error", "timed out after 1s"), process.output()
    pid = pid_of(tmp_path / "calls.log", "start freeze")
    assert running(pid)
    assert await echo(names[2], "meanwhile") == ("ok", {"result": "meanwhile"}, None)

    async def withdrawn_while_it_still_runs() -> bool:
        if not await withdrawn(redis, *names[:2]):
            return False
        assert running(pid), "its tools were withdrawn only once the hung process was gone"
        return True

    await wait_until(withdrawn_while_it_still_runs, timeout=15)  # 0.5 + 4 s, and the load
    assert await offered(redis, names[2])
    assert await echo(names[1], "hung") == (
        "error",
        None,
        "tool unavailable: the MCP server 'hung' is not connected",
    )
    assert await echo(names[2], "still") == ("ok", {"result": "still"}, None)
    await wait_until(lambda: not running(pid), timeout=15)  # the hung process is stopped

    refuse.unlink()
    await wait_until(lambda: offered(redis, *names), timeout=15)
    assert await echo(names[1], "back") == ("ok", {"result": "back"}, None), process.output()
    assert "MCP server hung: session lost or not started: " in process.output()
    assert "no answer to a ping within 4s" in process.output()
    process.signal(signal.SIGTERM)
    assert await process.wait() == 0, process.output()


async def test_a_tool_list_that_changes_silently_is_listed_again_after_its_ttl(
    bridge: Any, caller: RpcCaller, redis: Redis, tmp_path: Path, uid: str
) -> None:
    """``reshape`` adds ``extra`` and removes ``fail`` without a ``list_changed``
    notification: once ``list_ttl_s`` (1 s) passed, the tools are listed again, ``extra`` is
    announced and answers, ``fail`` is withdrawn and answers ``tool unavailable``."""
    prefix = f"l{uid}"
    server = stdio_fixture("listed", prefix=prefix, list_ttl_s=1)
    names = [f"{prefix}_reshape", f"{prefix}_fail", f"{prefix}_echo", f"{prefix}_extra"]
    process = await bridge({"servers": [server]}, names)
    await wait_until(lambda: offered(redis, *names[:3]), timeout=30)
    assert not await offered(redis, names[3])

    reshape = caller.request(names[0], {}, turn_id=f"t-{uid}")
    reply = await caller.call(reshape)
    assert (reply.status, reply.value) == ("ok", {"result": "reshaped"}), process.output()

    async def relisted() -> bool:
        return await offered(redis, names[3]) and await withdrawn(redis, names[1])

    await wait_until(relisted, timeout=15)  # 1 s + a health interval, and the load
    reply = await caller.call(caller.request(names[3], {}, turn_id=f"t-{uid}"))
    assert (reply.status, reply.value) == ("ok", {"result": "extra ran"}), process.output()
    fail = caller.request(names[1], {"message": "no"}, turn_id=f"t-{uid}")
    reply = await caller.call(fail)
    assert (reply.status, reply.error) == (
        "error",
        "tool unavailable: its MCP server no longer offers it",
    )
    assert await offered(redis, names[0], names[2])
    output = process.output()
    assert "MCP server listed: listed 9 tool(s) (ttl)" in output, output
    assert "(changed)" not in output
    process.signal(signal.SIGTERM)
    assert await process.wait() == 0, process.output()
