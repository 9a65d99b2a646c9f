"""``loopwire mcp serve`` driven by the ``mcp`` SDK's own client, over stdio and Streamable
HTTP, in front of a real worker: agents listed as tools, a call answered, a session kept
across calls, a call cancelled, a call waiting for a human decision reported as such (and
answered when nobody decides in time)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from support_rpc import AMQP_URL

from contracts.client import LoopwireClient
from contracts.events import TurnFinished
from harness import ROOT, CountingToolService, EventRecorder, WorkerProcess, free_port
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration

CLASSIFY_SCHEMA = {
    "type": "object",
    "properties": {"category": {"type": "string", "enum": ["billing", "technical"]}},
    "required": ["category"],
}


def agents_file(tmp_path: Path, tool: str, approval_timeout_s: float = 3600) -> Path:
    path = tmp_path / "agents.json"
    refunds = {"name": "refunds", "tools": [tool], "approval": [tool], "mcp": True}
    refunds["approval_timeout_s"] = approval_timeout_s
    agents: list[dict[str, Any]] = [
        {"name": "support", "description": "Answers support questions.", "tools": [tool]},
        refunds,
        {"name": "classifier", "tools": [], "output_schema": CLASSIFY_SCHEMA, "mcp": True},
        {"name": "internal", "tools": []},
    ]
    agents[0]["mcp"] = {"description": "Ask support anything."}
    path.write_text(json.dumps({"agents": agents}))
    return path


def workflows_file(tmp_path: Path) -> Path:
    """Workflows offered as tools: their output schemas come from their nodes."""
    path = tmp_path / "workflows.json"
    agents = [
        {"name": "classifier", "tools": [], "output_schema": CLASSIFY_SCHEMA},
        {"name": "writer", "tools": []},
    ]
    workflows = [
        {"name": "sort", "kind": "sequential", "mcp": True, "description": "Restate, then sort.",
         "nodes": [{"run": "writer"}, {"run": "classifier"}]},
        {"name": "both", "kind": "parallel", "mcp": True,
         "nodes": [{"run": "classifier"}, {"run": "writer"}]},
        {"name": "drafts", "kind": "sequential", "mcp": True,
         "nodes": [{"run": "classifier"}, {"run": "writer"}]},
        {"name": "polish", "kind": "loop", "mcp": True, "node": {"run": "classifier"},
         "until": {"field": "category", "equals": "billing"}},
        {"name": "route", "kind": "conditional", "mcp": True, "node": {"run": "classifier"},
         "on": "category", "routes": {"billing": {"run": "classifier", "id": "again"},
                                      "technical": {"run": "both"}}},
    ]  # fmt: skip
    path.write_text(json.dumps({"agents": agents, "workflows": workflows}))
    return path


def serve_args(agents: Path) -> list[str]:
    return [
        "-m",
        "worker.cli",
        "--amqp-url",
        AMQP_URL,
        "mcp",
        "serve",
        "--agents-file",
        str(agents),
    ]


@pytest.fixture
def server_log(tmp_path: Path) -> Iterator[TextIO]:
    """The server's stderr; at the end it must hold no error."""
    with (tmp_path / "mcp-serve.log").open("w+") as log:
        yield log
        log.seek(0)
        text = log.read()
    assert "Traceback" not in text and " ERROR " not in text, text


@contextlib.asynccontextmanager
async def over_stdio(
    agents: Path, log: TextIO, *extra: str, mode: str = "auto", logs: list[str] | None = None
) -> AsyncIterator[Client]:
    """``mode``: ``auto`` (the client's choice: protocol 2026-07-28) or ``legacy`` (the
    initialize handshake, 2025-11-25); ``logs`` collects the log messages the server sends."""

    async def logged(params: Any) -> None:
        if logs is not None:
            logs.append(str(params.data))

    params = StdioServerParameters(
        command=sys.executable, args=[*serve_args(agents), *extra], cwd=ROOT
    )
    transport = stdio_client(params, errlog=log)
    async with Client(transport, mode=mode, logging_callback=logged) as client:
        yield client


@contextlib.asynccontextmanager
async def over_http(agents: Path, log: TextIO, *extra: str) -> AsyncIterator[tuple[Client, int]]:
    """The server as its own process on a local port; yields a client and the metrics port."""
    port, metrics_port = free_port(), free_port()
    args = [*serve_args(agents), "--transport", "http", "--port", str(port)]
    args += ["--metrics-port", str(metrics_port), *extra]
    process = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=log, stderr=log)
    try:
        await _listening(port, process)
        async with Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp")) as client:
            yield client, metrics_port
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 20)


async def _listening(port: int, process: subprocess.Popen[bytes], timeout: float = 20) -> None:
    async with asyncio.timeout(timeout):
        while True:
            assert process.poll() is None, "loopwire mcp serve exited"
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                return
            await asyncio.sleep(0.05)


class Progress:
    """What a call's progress notifications said, in order."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.values: list[float] = []
        self._changed = asyncio.Condition()

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        self.values.append(progress)
        self.messages.append(message or "")
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, pattern: str, count: int = 1, timeout: float = 20) -> re.Match[str]:
        """The ``count``-th message matching ``pattern``, once it has come."""
        async with asyncio.timeout(timeout), self._changed:
            while True:
                found = [m for m in map(re.compile(pattern).search, self.messages) if m]
                if len(found) >= count:
                    return found[count - 1]
                await self._changed.wait()


def text_of(result: Any) -> str:
    return "".join(block.text for block in result.content)


async def test_over_stdio_agents_are_tools_that_answer_and_keep_a_session(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    server_log: TextIO,
    tmp_path: Path,
    uid: str,
) -> None:
    agents = agents_file(tmp_path, lookup.name)
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "order 7"}), content="Looking."))
    scripted_model.expect(Reply.text("Order 7 ships on Monday."))
    scripted_model.expect(Reply.text("Hello Ann."))
    scripted_model.expect(Reply.text("You are Ann."))
    scripted_model.expect(Reply.text('{"category": "billing"}'))
    session = f"s-{uid}-mcp"
    async with (
        WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker,
        over_stdio(agents, server_log) as mcp,
    ):
        listed = {tool.name: tool for tool in (await mcp.list_tools()).tools}
        progress = Progress()
        answer = await mcp.call_tool(
            "support", {"input": "Where is order 7?"}, progress_callback=progress
        )
        first = await mcp.call_tool("support", {"input": "I am Ann.", "session_id": session})
        second = await mcp.call_tool("support", {"input": "Who am I?", "session_id": session})
        classified = await mcp.call_tool("classifier", {"input": "I was charged twice."})
        wrong = await mcp.call_tool("support", {"question": "no input"})
    assert worker.errors() == []
    assert sorted(listed) == ["classifier", "refunds", "support"], "only the agents marked mcp"
    assert listed["support"].description == "Ask support anything."
    assert listed["support"].input_schema["required"] == ["input"]
    assert "session_id" in listed["support"].input_schema["properties"]
    assert listed["classifier"].output_schema == CLASSIFY_SCHEMA
    assert listed["support"].output_schema is None

    assert (answer.is_error, text_of(answer)) == (False, "Order 7 ships on Monday.")
    assert answer.meta is not None and answer.meta["loopwire/finish_reason"] == "stop"
    assert sum(lookup.executions.values()) == 1
    assert any(m.startswith("calling tool " + lookup.name) for m in progress.messages)
    assert any(m.startswith("step 1 done: tool_execution") for m in progress.messages), (
        progress.messages
    )
    assert progress.values == sorted(progress.values), "progress only grows"

    assert text_of(first) == "Hello Ann." and text_of(second) == "You are Ann."
    assert second.meta is not None and second.meta["loopwire/session_id"] == session
    seen = [(m["role"], m["content"]) for m in scripted_model.requests[3]["messages"]]
    assert seen[-3:] == [("user", "I am Ann."), ("assistant", "Hello Ann."), ("user", "Who am I?")]
    fresh = [m["content"] for m in scripted_model.requests[2]["messages"]]
    assert "Where is order 7?" not in fresh, "without a session_id, each call is a new session"

    assert classified.structured_content == {"category": "billing"}
    assert wrong.is_error and "input" in text_of(wrong)


async def test_a_workflow_lists_the_output_schema_of_its_last_node_and_answers_with_it(
    scripted_model: ScriptedModel, client: LoopwireClient, server_log: TextIO, tmp_path: Path
) -> None:
    agents = workflows_file(tmp_path)
    scripted_model.expect(Reply.text("The customer was charged twice."))
    scripted_model.expect(Reply.text('{"category": "billing"}'))
    async with (
        WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker,
        over_stdio(agents, server_log) as mcp,
    ):
        listed = {tool.name: tool for tool in (await mcp.list_tools()).tools}
        sorted_ = await mcp.call_tool("sort", {"input": "I paid twice for order 7."})
    assert worker.errors() == []
    assert sorted(listed) == ["both", "drafts", "polish", "route", "sort"]
    assert listed["sort"].output_schema == CLASSIFY_SCHEMA  # its last node's
    assert listed["polish"].output_schema == CLASSIFY_SCHEMA
    assert listed["drafts"].output_schema is None  # its last node answers with text
    both = {
        "type": "object",
        "properties": {
            "classifier": {"anyOf": [CLASSIFY_SCHEMA, {"type": "string"}]},
            "writer": {"type": "string"},
        },
        "required": ["classifier", "writer"],
        "additionalProperties": False,
    }
    assert listed["both"].output_schema == both
    assert listed["route"].output_schema == {  # one branch's or the other's: not an object
        "type": "object",
        "properties": {"output": {"anyOf": [CLASSIFY_SCHEMA, both]}},
        "required": ["output"],
    }
    assert (sorted_.is_error, sorted_.structured_content) == (False, {"category": "billing"})
    assert json.loads(text_of(sorted_)) == {"category": "billing"}
    asked = [m["content"] for m in scripted_model.requests[1]["messages"] if m["role"] == "user"]
    assert asked == ["The customer was charged twice."]  # the first node's answer


async def test_over_http_a_cancelled_call_cancels_its_turn(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    server_log: TextIO,
    tmp_path: Path,
) -> None:
    agents = agents_file(tmp_path, lookup.name)
    scripted_model.expect(Reply.text("Hello over HTTP."))
    scripted_model.expect(Reply.text("never sent", delay=40.0))
    async with (
        WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker,
        over_http(agents, server_log) as (mcp, metrics_port),
    ):
        listed = sorted(tool.name for tool in (await mcp.list_tools()).tools)
        answer = await mcp.call_tool("support", {"input": "hello"})
        async with anyio.create_task_group() as calls:
            calls.start_soon(mcp.call_tool, "support", {"input": "take your time"})
            await scripted_model.wait_for_requests(2, timeout=20)
            calls.cancel_scope.cancel()
        await events.wait_for(lambda evs: any(e.type == "turn.cancelled" for e in evs), 20)
        metrics = await _metrics(metrics_port)
    assert worker.errors() == []
    assert listed == ["classifier", "refunds", "support"]
    assert (answer.is_error, text_of(answer)) == (False, "Hello over HTTP.")
    [cancelled] = [e.data for e in events.events if e.type == "turn.cancelled"]
    assert isinstance(cancelled, TurnFinished)
    assert cancelled.result.stopped_by == "cancelled by the MCP client"
    assert 'loopwire_mcp_call_duration_seconds_count{outcome="answered",tool="support"} 1.0' in (
        metrics
    )
    assert 'loopwire_mcp_call_duration_seconds_count{outcome="cancelled",tool="support"} 1.0' in (
        metrics
    )
    assert 'loopwire_mcp_calls_in_progress{tool="support"} 0.0' in metrics


async def _metrics(port: int) -> str:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        return await response.text()


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_a_call_whose_turn_waits_for_a_decision_says_so_until_it_is_decided(
    mode: str,
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    server_log: TextIO,
    tmp_path: Path,
) -> None:
    agents = agents_file(tmp_path, lookup.name)
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refund 30"}), content="Asking."))
    scripted_model.expect(Reply.text("Refunded 30."))
    progress = Progress()
    logs: list[str] = []
    async with (
        WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker,
        over_stdio(agents, server_log, "--remind-every", "0.5", mode=mode, logs=logs) as mcp,
        anyio.create_task_group() as calls,
    ):
        answers: list[Any] = []

        async def call() -> None:
            answers.append(
                await mcp.call_tool("refunds", {"input": "refund me"}, progress_callback=progress)
            )

        calls.start_soon(call)
        waiting = r"waiting for a human decision on call (\S+) \(tool (\S+)\) until .*" + (
            r"loopwire approve\|reject (\S+) (\S+)$"
        )
        told = await progress.wait_for(waiting)
        await progress.wait_for(waiting, count=2)  # reminded while it still waits
        assert answers == [] and sum(lookup.executions.values()) == 0
        call_id, tool, turn_id = told.group(1), told.group(2), told.group(3)
        await client.decide(turn_id, call_id, "approve", by="maria")
    assert worker.errors() == []
    assert tool == lookup.name
    [answer] = answers
    assert (answer.is_error, text_of(answer)) == (False, "Refunded 30.")
    assert any(m == f"call {call_id}: approve by maria" for m in progress.messages)
    assert sum(lookup.executions.values()) == 1
    if mode == "legacy":  # log messages reach every caller; from 2026-07-28 on, those opting in
        assert told.group(0) in logs
    else:
        assert logs == []


async def test_a_call_whose_decision_never_comes_answers_with_the_turns_outcome(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    server_log: TextIO,
    tmp_path: Path,
) -> None:
    """Nobody decides: the wait is reported (and reminded) until the agent's
    ``approval_timeout_s`` (2 s) rejects the call; the turn goes on, and the MCP call answers
    with its outcome, never hanging on a decision that will not come."""
    agents = agents_file(tmp_path, lookup.name, approval_timeout_s=2)
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refund 30"}), content="Asking."))
    scripted_model.expect(Reply.text("Nobody approved the refund."))
    progress = Progress()
    metrics_port = free_port()
    extra = ("--remind-every", "0.5", "--metrics-port", str(metrics_port))
    async with (
        WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker,
        over_stdio(agents, server_log, *extra) as mcp,
    ):
        async with asyncio.timeout(30):  # the approval's 2 s, the turn's steps and the load
            answer = await mcp.call_tool(
                "refunds", {"input": "refund me"}, progress_callback=progress
            )
        metrics = await _metrics(metrics_port)
    assert worker.errors() == []
    assert (answer.is_error, text_of(answer)) == (False, "Nobody approved the refund.")
    assert answer.meta is not None and answer.meta["loopwire/finish_reason"] == "stop"
    told = await progress.wait_for(r"waiting for a human decision on call (\S+) \(tool (\S+)\)")
    call_id, tool = told.groups()
    assert tool == lookup.name
    decided = progress.messages.index(f"call {call_id}: reject by timeout")
    waited = [i for i, m in enumerate(progress.messages) if m.startswith("waiting for")]
    assert max(waited) < decided, progress.messages  # told while it waited, not after
    [seen] = [m["content"] for m in scripted_model.requests[1]["messages"] if m["role"] == "tool"]
    assert "rejected by timeout: no decision within" in seen
    assert sum(lookup.executions.values()) == 0
    assert 'loopwire_mcp_calls_waiting_for_approval{tool="refunds"} 0.0' in metrics
    assert 'loopwire_mcp_call_duration_seconds_count{outcome="answered",tool="refunds"} 1.0' in (
        metrics
    )


async def test_over_stdio_a_call_cancelled_while_it_waits_for_a_decision_cancels_its_turn(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    server_log: TextIO,
    tmp_path: Path,
) -> None:
    agents = agents_file(tmp_path, lookup.name)
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refund"}), content="Asking."))
    progress = Progress()
    metrics_port = free_port()
    async with (
        WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker,
        over_stdio(agents, server_log, "--metrics-port", str(metrics_port)) as mcp,
    ):
        async with anyio.create_task_group() as calls:
            calls.start_soon(
                partial(mcp.call_tool, "refunds", {"input": "refund"}, progress_callback=progress)
            )
            await progress.wait_for("waiting for a human decision")
            waiting = await _metrics(metrics_port)
            calls.cancel_scope.cancel()
        await events.wait_for(lambda evs: any(e.type == "turn.cancelled" for e in evs), 20)
        metrics = await _metrics(metrics_port)
    assert worker.errors() == []
    assert 'loopwire_mcp_calls_waiting_for_approval{tool="refunds"} 1.0' in waiting
    assert 'loopwire_mcp_calls_waiting_for_approval{tool="refunds"} 0.0' in metrics
    assert 'loopwire_mcp_call_duration_seconds_count{outcome="cancelled",tool="refunds"} 1.0' in (
        metrics
    )
    [cancelled] = [e.data for e in events.events if e.type == "turn.cancelled"]
    assert isinstance(cancelled, TurnFinished)
    assert (cancelled.result.stopped_by, cancelled.result.content) == (
        "cancelled by the MCP client",
        "Asking.",
    )
    assert sum(lookup.executions.values()) == 0
