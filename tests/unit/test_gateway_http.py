"""The HTTP gateway's pieces that need no fleet: API keys, the protocol's shapes of
messages, runs and inputs, and the command line's refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from openapi_spec_validator import validate
from redis.asyncio import Redis
from starlette.routing import Route

from contracts.base import SAFE_ID_PATTERN
from contracts.control import ApprovalRequest
from contracts.messages import ChatMessage, ToolCall
from contracts.sessions import TurnInfo
from gateway.http import shapes
from gateway.http.app import Gateway, openapi_document
from gateway.http.approvals import decisions
from gateway.http.errors import RunError
from gateway.http.fleet import Fleet
from gateway.http.keys import ApiKeys, new_key
from gateway.http.streams import Cursor
from gateway.http.webhooks import Destinations

ROOT = Path(__file__).resolve().parents[2]


def test_a_key_is_found_by_its_hash_and_nothing_else_is() -> None:
    key, entry = new_key("web", "shop")
    keys = ApiKeys([entry])
    found = keys.find(key)
    assert found is not None and found.tenant == "shop" and found.name == "web"
    assert keys.find(key + "x") is None
    assert keys.find(entry.sha256) is None  # the file's content opens nothing
    with pytest.raises(ValueError, match="not a tenant name"):
        new_key("web", "no such/tenant")


def test_messages_take_the_protocols_shape() -> None:
    call = ToolCall(id="c1", name="search", arguments='{"q": "x"}')
    history = [
        ChatMessage.user("hi"),
        ChatMessage(role="assistant", content=None, tool_calls=(call,)),
        ChatMessage(role="tool", content="found", tool_call_id="c1"),
    ]
    shaped = shapes.values(history, "th")["messages"]
    assert [m["type"] for m in shaped] == ["human", "ai", "tool"]
    assert [m["id"] for m in shaped] == ["th:0", "th:1", "th:2"]
    assert shaped[1]["tool_calls"] == [
        {"name": "search", "args": {"q": "x"}, "id": "c1", "type": "tool_call"}
    ]
    assert shaped[2]["tool_call_id"] == "c1"


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (None, "input must be"),
        ({"messages": []}, "no messages"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "not 'assistant'"),
        ({"messages": [{"role": "user", "content": ""}]}, "no text content"),
        ({"messages": [3]}, "an object or a string"),
    ],
)
def test_an_input_that_is_not_the_users_text_is_refused_saying_why(
    payload: object, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        shapes.input_texts(payload)


def test_inputs_as_text_roles_types_and_content_blocks() -> None:
    texts = shapes.input_texts(
        {
            "messages": [
                "plain",
                {"type": "human", "content": "typed"},
                {"role": "user", "content": [{"type": "text", "text": "block"}]},
            ]
        }
    )
    assert texts == ["plain", "typed", "block"]


def test_a_turns_status_as_a_runs() -> None:
    assert shapes.run_status(None) == "pending"
    assert shapes.run_status(TurnInfo(turn_id="t", status="queued")) == "pending"
    assert shapes.run_status(TurnInfo(turn_id="t", status="waiting")) == "running"
    done = TurnInfo(turn_id="t", status="done", finish_reason="error")
    assert shapes.run_status(done) == "error"
    assert shapes.run_status(TurnInfo(turn_id="t", status="done", finish_reason="stop")) == (
        "success"
    )


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_the_command_line_makes_a_key_and_refuses_to_serve_without_keys(tmp_path: Path) -> None:
    made = run_cli("gateway", "key", "--name", "web", "--for-tenant", "shop")
    assert made.returncode == 0, made.stderr
    line = json.loads(made.stdout.splitlines()[-1])
    key = made.stdout.split("shown once): ")[1].split()[0]
    found = ApiKeys.load_entries([line]).find(key)
    assert found is not None and found.tenant == "shop"
    refused = run_cli("gateway", "serve", env={"PATH": "/usr/bin:/bin"})
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        "error: no API keys: give --keys-file or set LOOPWIRE_GATEWAY__KEYS_FILE"
    )
    bad = tmp_path / "keys.json"
    bad.write_text('{"keys": []}')
    refused = run_cli("gateway", "serve", "--keys-file", str(bad), env={"PATH": "/usr/bin:/bin"})
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr == (
        f"error: keys file {bad}: keys: list should have at least 1 item after validation, not 0\n"
    )


def test_an_event_id_says_where_the_client_is_and_a_bad_one_is_no_place() -> None:
    assert str(Cursor(3, 120, 7)) == "3.120.7"
    assert Cursor.parse("3.120.7") == Cursor(3, 120, 7)
    assert Cursor.parse("end") == Cursor(ended=True)
    for bad in (None, "", "7", "1.2", "a.b.c", "1.-2.3", "1.2.3.4"):
        assert Cursor.parse(bad) is None


def waiting_calls(*ids: str) -> list[ApprovalRequest]:
    return [
        ApprovalRequest(
            turn_id="t", session_id="s", agent="a", call_id=i, tool="x", arguments="{}", since=n
        )
        for n, i in enumerate(ids)
    ]


def test_a_resume_decides_every_waiting_call_or_each_by_its_id() -> None:
    calls = waiting_calls("c1", "c2")
    every = decisions({"decision": "approve"}, calls)
    assert [(d.call_id, d.verdict) for d in every] == [("c1", "approve"), ("c2", "approve")]
    each = decisions(
        {"c2": {"decision": "edit", "arguments": {"q": 1}}, "c1": {"decision": "reject"}}, calls
    )
    assert [(d.call_id, d.verdict, d.arguments) for d in each] == [
        ("c1", "reject", None),
        ("c2", "edit", {"q": 1}),
    ]


@pytest.mark.parametrize(
    ("resume", "why"),
    [
        ("yes", "resume is"),
        ({}, "resume is"),
        ({"c9": {"decision": "approve"}}, "no call 'c9' waits"),
        ({"decision": "maybe"}, "decision is one of"),
        ({"c1": {"decision": "edit"}}, "an edit gives the arguments"),
        ({"c1": {"decision": "reject", "message": 3}}, "message is text"),
    ],
)
def test_a_resume_that_cannot_be_done_is_refused_saying_why(resume: object, why: str) -> None:
    with pytest.raises(RunError, match=why) as refused:
        decisions(resume, waiting_calls("c1"))
    assert refused.value.status == 422


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://127.0.0.1:9/x", False),
        ("http://10.0.0.7/x", False),
        ("http://169.254.169.254/latest/meta-data", False),
        ("http://[::1]/x", False),
        ("http://192.168.1.2/x", True),  # its network is allowed
        ("http://hooks.internal/x", True),  # its name is allowed
        ("http://8.8.8.8/x", True),
        ("ftp://8.8.8.8/x", False),
        ("not a url", False),
    ],
)
async def test_a_webhook_never_reaches_an_internal_address_unless_allowed(
    url: str, allowed: bool
) -> None:
    destinations = Destinations(["192.168.0.0/16", "hooks.internal"])
    if allowed:
        await destinations.check(url)
    else:
        with pytest.raises(RunError) as refused:
            await destinations.check(url)
        assert refused.value.status == 422


def test_the_openapi_document_is_valid_and_names_every_route_and_nothing_else() -> None:
    document = openapi_document()
    validate(document)  # raises unless a valid OpenAPI document
    gateway = Gateway(
        fleet=Fleet(("amqp://127.0.0.1/",), None),
        redis=Redis(),
        keys=ApiKeys([new_key("k", None)[1]]),
        assistants=[],
        ttl_s=60,
        max_body_bytes=1024,
        wait_timeout_s=1,
    )
    served = {
        (route.path, method.lower())
        for route in gateway.app().routes
        if isinstance(route, Route)
        for method in (route.methods or ()) - {"HEAD"}
    }
    documented = {
        (path, method)
        for path, item in document["paths"].items()
        for method in item
        if method != "parameters"
    }
    assert served == documented
    safe = document["components"]["schemas"]["Id"]["pattern"]
    assert safe == SAFE_ID_PATTERN
