"""The tool service SDK and example tools without RabbitMQ or Redis."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, cast

import pytest
from pydantic import BaseModel

from contracts.codec import decode
from contracts.tools import ToolCallReply, ToolCallRequest, ToolContext
from tool_services.calculator.evaluator import EvaluationError, evaluate, format_exact
from tool_services.execute import encode_reply, run_tool
from tool_services.runner import available, load_factory
from tool_services.sdk import CallContext, OutcomeUnknown, ToolError, ToolResult, ToolService
from tool_services.search.index import SearchIndex
from tool_services.search.service import DOCS_DIR
from tool_services.settings import Settings


class Args(BaseModel):
    query: str
    limit: int = 5


def request(tool: str, arguments: dict[str, Any], *, deadline_s: float = 10) -> ToolCallRequest:
    return ToolCallRequest(
        call_id="c1",
        tool=tool,
        arguments=arguments,
        context=ToolContext(
            session_id="s1",
            turn_id="t1",
            agent="a",
            deadline=time.time() + deadline_s,
            idempotency_key="t1:c1",
        ),
    )


def context(req: ToolCallRequest) -> CallContext:
    return CallContext(
        call_id=req.call_id,
        tool=req.tool,
        session_id=req.context.session_id,
        turn_id=req.context.turn_id,
        agent=req.context.agent,
        metadata={},
        deadline=req.context.deadline,
        idempotency_key=req.context.idempotency_key,
        redis=cast(Any, None),
    )


def test_a_tool_definition_comes_from_the_argument_model_and_the_docstring() -> None:
    service = ToolService("demo")

    @service.tool(timeout_s=5, idempotent=False)
    async def find(args: Args, ctx: CallContext) -> dict[str, Any]:
        """Find things."""
        return {"results": []}

    (definition,) = service.definitions()
    assert definition.name == "find"
    assert definition.description == "Find things."
    assert definition.parameters == Args.model_json_schema()
    assert (definition.timeout_s, definition.idempotent) == (5, False)
    renamed = service.renamed({"find": "find_v2"})
    assert list(renamed.tools) == ["find_v2"]
    assert list(service.tools) == ["find"]


def test_tools_must_be_async_typed_and_uniquely_named() -> None:
    service = ToolService("demo")

    def sync(args: Args, ctx: CallContext) -> None: ...

    async def untyped(args, ctx):  # type: ignore[no-untyped-def]
        return None

    async def ok(args: Args, ctx: CallContext) -> None: ...

    with pytest.raises(TypeError, match="async"):
        service.add_tool(sync)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pydantic model"):
        service.add_tool(untyped)
    with pytest.raises(ValueError, match="invalid tool name"):
        service.add_tool(ok, name="no spaces")
    service.add_tool(ok)
    with pytest.raises(ValueError, match="already registered"):
        service.add_tool(ok)


async def test_run_tool_turns_every_outcome_into_a_reply() -> None:
    service = ToolService("demo")

    @service.tool()
    async def echo(args: Args, ctx: CallContext) -> ToolResult:
        if args.query == "fail":
            raise ToolError("no luck")
        if args.query == "crash":
            raise KeyError("k")
        if args.query == "odd":
            return ToolResult(value={1, 2})
        if args.query == "gone":
            raise OutcomeUnknown("the server went away mid-call")
        return ToolResult(value={"q": args.query}, state_updates={"seen": 1})

    tool = service.tools["echo"]

    async def run(arguments: dict[str, Any]) -> ToolCallReply:
        req = request("echo", arguments)
        return decode(encode_reply(await run_tool(tool, req, context(req))), ToolCallReply)

    ok = await run({"query": "x"})
    assert (ok.status, ok.value, ok.state_updates) == ("ok", {"q": "x"}, {"seen": 1})
    assert (await run({})).error == "invalid arguments: query: Field required"
    assert (await run({"query": "fail"})).error == "no luck"
    assert (await run({"query": "crash"})).error == "KeyError: 'k'"
    odd = await run({"query": "odd"})
    assert odd.status == "ok"  # a set is JSON-able as a list
    assert sorted(odd.value) == [1, 2]
    gone = await run({"query": "gone"})
    assert (gone.status, gone.error) == ("unknown", "the server went away mid-call")


def test_a_dynamic_service_changes_its_tools_and_offers_only_some() -> None:
    service = ToolService("bridge", dynamic=True)
    changes: list[int] = []
    service.watch(lambda: changes.append(len(service.tools)))

    async def fn(args: Args, ctx: CallContext) -> None:
        return None

    one = service.add_tool(fn, name="one")
    two = replace(service.add_tool(fn, name="two"), offered=False)
    service.replace_tools([one, two])
    assert changes == [2]
    assert set(service.tools) == {"one", "two"}  # both served
    assert [d.name for d in service.definitions()] == ["one"]  # one announced
    service.replace_tools([])
    assert changes == [2, 0]
    with pytest.raises(RuntimeError, match="not dynamic"):
        ToolService("fixed").replace_tools([one])


async def test_a_value_that_cannot_travel_is_an_error_reply() -> None:
    service = ToolService("demo")

    @service.tool()
    async def big(args: Args, ctx: CallContext) -> Any:
        return object() if args.query == "object" else 2**80

    req = request("big", {"query": "object"})
    reply = decode(
        encode_reply(await run_tool(service.tools["big"], req, context(req))), ToolCallReply
    )
    assert reply.status == "error"
    assert reply.error is not None
    assert "not JSON-able" in reply.error
    req = request("big", {"query": "int"})
    reply = decode(
        encode_reply(await run_tool(service.tools["big"], req, context(req))), ToolCallReply
    )
    assert reply.status == "error"


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2**100 / 3", "1267650600228229401496703205376/3"),
        ("0.1 + 0.2", "3/10"),
        ("-(7 // 2) + 7 % 3", "-2"),
        ("sqrt(9/4) * 2", "3"),
        ("(-2) ** -3", "-1/8"),
        ("max(1, 5/2, 2) + abs(-1)", "7/2"),
        ("factorial(20)", "2432902008176640000"),
        ("round(2.5) + floor(-0.5) + ceil(0.1)", "2"),
    ],
)
def test_the_calculator_is_exact(expression: str, value: str) -> None:
    assert format_exact(evaluate(expression)) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1/0", "division by zero"),
        ("10**10**10", "more than 4000 digits"),
        ("9**9**9", "more than 4000 digits"),
        ("sqrt(2)", "irrational"),
        ("2^8", r"use \*\* for powers"),
        ("__import__('os').system('true')", "only plain function calls"),
        ("[1, 2]", "List is not allowed"),
        ("open('x')", "unknown function 'open'"),
        ("x + 1", "unknown name 'x'"),
        ("2 ** 0.5", "exponents must be integers"),
        ("1+" * 300 + "1", "too complex"),
        ("1e400", "too large"),
        ("", "empty"),
        ("1 +", "not an arithmetic expression"),
    ],
)
def test_the_calculator_refuses_with_a_readable_error(expression: str, message: str) -> None:
    with pytest.raises(EvaluationError, match=message):
        evaluate(expression)


def test_search_ranks_and_never_errors_on_query_syntax() -> None:
    index = SearchIndex.from_directory(DOCS_DIR)
    try:
        assert index.size >= 15
        (best, *_) = index.search("graceful shutdown SIGTERM")
        assert best.path == "docs/graceful-shutdown.md"
        assert best.score > 0
        assert index.search("xyzzy plugh") == []
        for hostile in [
            '"',
            "NEAR(a b)",
            "a* OR -b",
            "title:foo",
            "()",
            "AND",
            "'; DROP TABLE docs",
        ]:
            index.search(hostile)
        assert index.search("   ") == []
        assert len(index.search("tool", limit=2)) == 2
    finally:
        index.close()


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOPWIRE_TOOLS__CONCURRENCY", "7")
    monkeypatch.setenv("LOOPWIRE_TOOLS__GRACE_S", "3.5")
    monkeypatch.setenv("LOOPWIRE_REDIS_URL", "redis://elsewhere:6379/1")
    settings = Settings()
    assert (settings.tools.concurrency, settings.tools.grace_s) == (7, 3.5)
    assert settings.tools.announce_interval_s == 5.0
    assert settings.tools.announce_ttl_s == 45.0
    assert settings.tools.reconnect_interval_s == 1.0
    assert settings.tools.idempotency_ttl_s == 86_400
    assert settings.redis_url == "redis://elsewhere:6379/1"


def test_services_are_found_by_name() -> None:
    assert available() == ["calculator", "mcp", "memory", "notes", "search"]
    factory = load_factory("calculator")
    assert list(factory().tools) == ["calculate"]
    with pytest.raises(LookupError, match="unknown tool service"):
        load_factory("nope")
    with pytest.raises(LookupError, match="invalid"):
        load_factory("../etc")
