"""The MCP bridge without a broker: its configuration, names, results, and calls to a real MCP
server (``tests.mcp_fixtures.server`` over stdio, a child process)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mcp.types as mcp_types
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from tool_services.mcp.bridge import McpBridge
from tool_services.mcp.check import run_check
from tool_services.mcp.config import SCHEMA_FILE, BridgeConfig, json_schema
from tool_services.mcp.names import map_tools, schema_problem, served_name
from tool_services.mcp.results import value_of
from tool_services.mcp.settings import McpSettings
from tool_services.sdk import CallContext, OutcomeUnknown, ToolError

REPO = Path(__file__).resolve().parents[2]


def fixture_server(prefix: str = "fx", log: Path | None = None, **extra: Any) -> dict[str, Any]:
    env = ["PYTHONPATH"] + (["MCP_FIXTURE_LOG"] if log else [])
    return {
        "name": prefix,
        "stdio": {
            "command": sys.executable,
            "args": ["-m", "tests.mcp_fixtures.server", "stdio"],
            "cwd": str(REPO),
            "env": env,
        },
        **extra,
    }


# -- configuration ---------------------------------------------------------------------------


def test_the_checked_in_json_schema_is_up_to_date() -> None:
    assert json.loads(SCHEMA_FILE.read_text()) == json_schema(), (
        "run `python -m tool_services.mcp schema` and commit tool_services/mcp/config.schema.json"
    )


@pytest.mark.parametrize(
    ("server", "message"),
    [
        ({"name": "a"}, "give exactly one of stdio and http"),
        (
            {"name": "a", "http": {"url": "http://x/mcp"}, "stdio": {"command": "x"}},
            "give exactly one of stdio and http",
        ),
        ({"name": "a", "http": {"url": "ftp://x"}}, "should match pattern"),
        (
            {"name": "a", "http": {"url": "http://x"}, "allow": ["t"], "deny": ["u"]},
            "allow or deny, not both",
        ),
        ({"name": "a", "stdio": {"command": "x", "env": ["A B"]}}, "invalid environment"),
        ({"name": "a", "http": {"url": "http://x"}, "retries": 3}, "Extra inputs"),
    ],
)
def test_an_invalid_server_is_refused_with_the_reason(server: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        BridgeConfig.model_validate({"servers": [server]})


def test_servers_must_not_share_a_prefix() -> None:
    servers = [
        {"name": "a", "prefix": "p", "http": {"url": "http://x"}},
        {"name": "p", "http": {"url": "http://y"}},
    ]
    with pytest.raises(ValidationError, match="share a prefix: p"):
        BridgeConfig.model_validate({"servers": servers})


def test_check_names_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(
        json.dumps(
            {
                "servers": [
                    {"name": "a", "stdio": {"command": "no-such-program-here"}},
                    {
                        "name": "b",
                        "http": {
                            "url": "http://x",
                            "header_files": {"Authorization": str(tmp_path / "missing")},
                        },
                    },
                ]
            }
        )
    )
    assert run_check(path) == 2
    err = capsys.readouterr().err
    assert "command 'no-such-program-here' not found" in err
    assert "header Authorization: cannot read" in err
    (tmp_path / "missing").write_text("Bearer s3cret\n")
    path.write_text(json.dumps({"servers": [fixture_server()]}))
    assert run_check(path, connect=True) == 0
    out = capsys.readouterr().out
    assert "fx: serving fx_add, fx_echo, fx_fail" in out


def test_header_files_are_read_less_the_trailing_newline(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("Bearer s3cret\n")
    config = BridgeConfig.model_validate(
        {
            "servers": [
                {
                    "name": "a",
                    "http": {
                        "url": "http://x",
                        "headers": {"X-Team": "support"},
                        "header_files": {"Authorization": str(tmp_path / "token")},
                    },
                }
            ]
        }
    )
    http = config.servers[0].http
    assert http is not None
    assert http.resolved_headers() == {"X-Team": "support", "Authorization": "Bearer s3cret"}


# -- names and schemas -----------------------------------------------------------------------


def tool(name: str, schema: Any = None, description: str = "d") -> mcp_types.Tool:
    return mcp_types.Tool.model_construct(
        name=name,
        description=description,
        input_schema={"type": "object", "properties": {}} if schema is None else schema,
    )


def test_names_are_prefixed_and_unmappable_ones_refused_with_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = BridgeConfig.model_validate(
        {"servers": [{"name": "gh", "http": {"url": "http://x"}, "deny": ["drop"]}]}
    ).servers[0]
    assert served_name("gh", "files/read") == "gh_files_read"
    assert served_name("gh", "x" * 70) is None
    tools = [
        tool("search"),
        tool("files.read"),
        tool("has space"),
        tool("x" * 70),
        tool("bad_schema", {"type": "object", "properties": {"a": {"type": 12}}}),
        tool("not_object", {"type": "string"}),
        tool("drop"),
    ]
    with caplog.at_level(logging.ERROR, "loopwire.mcp"):
        mapped = map_tools(server, tools)
    assert [m.definition.name for m in mapped] == ["gh_search", "gh_files_read"]
    assert [m.mcp_name for m in mapped] == ["search", "files.read"]
    refused = caplog.text
    for name in ("'has space'", "'x" + "x" * 69 + "'", "'bad_schema'", "'not_object'"):
        assert f"tool {name} refused" in refused
    assert "drop" not in refused  # denied, not refused


def test_overrides_set_idempotency_timeouts_and_approval() -> None:
    server = BridgeConfig.model_validate(
        {
            "servers": [
                {
                    "name": "a",
                    "http": {"url": "http://x"},
                    "timeout_s": 12,
                    "tools": {"get": {"idempotent": True, "timeout_s": 3, "approval": True}},
                }
            ]
        }
    ).servers[0]
    hinted = tool("put").model_copy(
        update={"annotations": mcp_types.ToolAnnotations(idempotent_hint=True)}
    )
    mapped = {m.mcp_name: m.definition for m in map_tools(server, [tool("get"), hinted])}
    assert (mapped["get"].idempotent, mapped["get"].timeout_s) == (True, 3)
    # the server's idempotentHint is a claim: not trusted unless configured
    assert (mapped["put"].idempotent, mapped["put"].timeout_s) == (False, 12)
    # a tool configured for approval says so in its definition (the workers park its calls)
    assert (mapped["get"].approval, mapped["put"].approval) == (True, False)


def test_schema_problems() -> None:
    assert schema_problem({"type": "object", "properties": {"a": {"type": "string"}}}) is None
    assert schema_problem([]) == "its inputSchema is not an object"
    assert "not a valid JSON Schema" in str(schema_problem({"type": "object", "required": "a"}))


# -- results ---------------------------------------------------------------------------------


def result(*content: Any, structured: Any = None, error: bool = False) -> mcp_types.CallToolResult:
    return mcp_types.CallToolResult(
        content=list(content), structured_content=structured, is_error=error
    )


def text(value: str) -> mcp_types.TextContent:
    return mcp_types.TextContent(type="text", text=value)


def test_results_become_values_and_errors() -> None:
    image = mcp_types.ImageContent(type="image", data="aGVsbG8=", mime_type="image/png")
    assert value_of(result(text("a"), text("b"))) == "a\n\nb"
    assert value_of(result(text("{}"), structured={"total": 3})) == {"total": 3}
    assert value_of(result(image)) == "[image: image/png, 5 bytes, not shown]"
    assert value_of(result(text("x"), image, structured={"k": 1})) == {
        "k": 1,
        "content_not_shown": ["[image: image/png, 5 bytes, not shown]"],
    }
    link = mcp_types.ResourceLink(type="resource_link", uri="file:///a.txt", name="a")
    assert value_of(result(link)) == "[resource link: file:///a.txt, not fetched]"
    with pytest.raises(ToolError, match=r"^out of stock$"):
        value_of(result(text("out of stock"), error=True))


# -- calls to a real MCP server --------------------------------------------------------------


class Bridge:
    """A bridge's service with its sessions started, its tools called directly."""

    def __init__(self, config: dict[str, Any], **settings: Any) -> None:
        self.registry = CollectorRegistry()
        self.bridge = McpBridge(
            BridgeConfig.model_validate(config),
            McpSettings(health_interval_s=0.3, restart_min_s=0.1, **settings),
        )
        self.service = self.bridge.service

    async def __aenter__(self) -> Bridge:
        await self.service.startup(self.registry)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.service.shutdown()

    async def call(self, name: str, arguments: dict[str, Any], deadline_s: float = 20) -> Any:
        tool = self.service.tools[name]
        ctx = CallContext(
            call_id="c1",
            tool=name,
            session_id="s",
            turn_id="t",
            agent="a",
            metadata={},
            deadline=time.time() + deadline_s,
            idempotency_key="t:c1",
            redis=None,  # type: ignore[arg-type]
        )
        return await tool.fn(tool.args_model.model_validate(arguments), ctx)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


async def wait_for_line(path: Path, prefix: str, timeout: float = 10) -> str:
    """The first line of the fixture's log starting with ``prefix``, once it is there."""
    async with asyncio.timeout(timeout):
        while True:
            for line in await asyncio.to_thread(_lines, path):
                if line.startswith(prefix):
                    return line
            await asyncio.sleep(0.02)


async def wait_offered(bridge: Bridge, name: str, offered: bool, timeout: float = 10) -> None:
    """Until the bridge offers (or no longer offers) the tool ``name``."""
    changed = asyncio.Event()
    bridge.service.watch(changed.set)
    async with asyncio.timeout(timeout):
        while any(d.name == name for d in bridge.service.definitions()) != offered:
            await changed.wait()
            changed.clear()


@pytest.fixture
def pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))


@pytest.mark.usefixtures("pythonpath")
async def test_calls_values_errors_timeouts_and_cancellation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "calls.log"
    monkeypatch.setenv("MCP_FIXTURE_LOG", str(log))
    config = {"servers": [fixture_server(log=log, tools={"slow": {"timeout_s": 0.5}})]}
    async with Bridge(config) as bridge:
        assert {d.name for d in bridge.service.definitions()} >= {"fx_add", "fx_slow"}
        assert await bridge.call("fx_add", {"terms": [1, 2]}) == {"total": 3, "terms": [1, 2]}
        assert await bridge.call("fx_echo", {"text": "hi"}) == {"result": "hi"}
        with pytest.raises(ToolError, match="boom"):
            await bridge.call("fx_fail", {"message": "boom"})
        with pytest.raises(ToolError, match=r"^timed out after 0\.5s$"):
            await bridge.call("fx_slow", {"seconds": 10, "tag": "t1"})
        # the SDK told the server: it cancelled the call
        await wait_for_line(log, "cancelled slow t1")
        # and the model's own deadline bounds the MCP request too
        with pytest.raises(ToolError, match=r"timed out after 0\.3"):
            await bridge.call("fx_slow", {"seconds": 10, "tag": "t2"}, deadline_s=0.3)


@pytest.mark.usefixtures("pythonpath")
async def test_the_child_gets_only_the_variables_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOPWIRE_SECRET_OF_THE_BRIDGE", "x")
    monkeypatch.setenv("PASSED_ON", "yes")
    server = fixture_server()
    server["stdio"]["env"] = ["PYTHONPATH", "PASSED_ON"]
    async with Bridge({"servers": [server]}) as bridge:
        for name, expected in (
            ("PASSED_ON", "yes"),
            ("LOOPWIRE_SECRET_OF_THE_BRIDGE", None),
            ("HOME", None),
            ("PATH", None),
        ):
            assert await bridge.call("fx_getenv", {"name": name}) == {"value": expected}, name


@pytest.mark.usefixtures("pythonpath")
async def test_the_trace_context_travels_in_meta(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "calls.log"
    monkeypatch.setenv("MCP_FIXTURE_LOG", str(log))
    span = NonRecordingSpan(
        SpanContext(
            trace_id=0x0AF7651916CD43DD8448EB211C80319C,
            span_id=0xB7AD6B7169203331,
            is_remote=False,
            trace_flags=TraceFlags(1),
        )
    )
    async with Bridge({"servers": [fixture_server(log=log)]}) as bridge:
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            await bridge.call("fx_echo", {"text": "traced"})
        finally:
            otel_context.detach(token)
    line = await wait_for_line(log, "start echo traced")
    assert line.endswith("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")


@pytest.mark.usefixtures("pythonpath")
async def test_a_server_gone_mid_call_is_unknown_and_unavailable_until_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log, refuse = tmp_path / "calls.log", tmp_path / "refuse"
    monkeypatch.setenv("MCP_FIXTURE_LOG", str(log))
    monkeypatch.setenv("MCP_FIXTURE_REFUSE_FILE", str(refuse))
    server = fixture_server(log=log)
    server["stdio"]["env"] += ["MCP_FIXTURE_REFUSE_FILE"]
    async with Bridge({"servers": [server]}) as bridge:
        call = asyncio.create_task(bridge.call("fx_slow", {"seconds": 30, "tag": "k"}))
        pid = int((await wait_for_line(log, "start slow k")).split()[-1])
        refuse.touch()
        os.kill(pid, 9)
        with pytest.raises(OutcomeUnknown, match="may or may not have taken effect"):
            await call
        await wait_offered(bridge, "fx_slow", False)  # served, not offered: unavailable
        with pytest.raises(ToolError, match=r"^tool unavailable: the MCP server 'fx'"):
            await bridge.call("fx_echo", {"text": "x"})
        refuse.unlink()
        await wait_offered(bridge, "fx_slow", True)
        assert await bridge.call("fx_echo", {"text": "back"}) == {"result": "back"}
        sample = bridge.registry.get_sample_value
        assert (
            sample("loopwire_mcp_calls_total", {"server": "fx", "outcome": "connection_lost"}) == 1
        )
        assert sample("loopwire_mcp_calls_total", {"server": "fx", "outcome": "unavailable"}) == 1
        assert sample("loopwire_mcp_calls_total", {"server": "fx", "outcome": "ok"}) == 1
        assert (sample("loopwire_mcp_server_restarts_total", {"server": "fx"}) or 0) >= 1
        assert sample("loopwire_mcp_server_up", {"server": "fx"}) == 1
        refreshes = {"server": "fx", "trigger": "connect"}
        assert (sample("loopwire_mcp_tool_list_refreshes_total", refreshes) or 0) >= 2


def test_the_cli_checks_a_file(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    server = {"name": "a", "http": {"url": "http://x"}, "tools": {"t": {"approval": "maybe"}}}
    path.write_text(json.dumps({"servers": [server]}))
    done = subprocess.run(
        [sys.executable, "-m", "worker.cli", "tools", "mcp-check", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 2
    assert "approval" in done.stderr and "Traceback" not in done.stderr
