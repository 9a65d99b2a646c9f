"""An agent as an MCP tool, without a broker: its listing, its arguments, what each end of a
turn answers, and the agents file's ``mcp`` marks."""

from __future__ import annotations

import time
from typing import Any

import pytest

from contracts.turns import TurnError, TurnResult
from gateway.mcp.tools import ExposedTool, parse_arguments, tool_result
from worker.cli.mcp import exposed_tools
from worker.errors import CliError


def result(finish_reason: str, content: str | None = "text", **fields: Any) -> TurnResult:
    return TurnResult(
        turn_id="t-1",
        session_id="s-1",
        agent="support",
        content=content,
        finish_reason=finish_reason,  # type: ignore[arg-type]
        steps=1,
        duration_s=0.1,
        completed_at=time.time(),
        **fields,
    )


def test_a_schema_whose_root_is_not_an_object_is_listed_and_answered_under_output() -> None:
    tool = ExposedTool("lister", "Lists.", {"type": "array", "items": {"type": "string"}})
    listed = tool.listing()
    assert listed.output_schema == {
        "type": "object",
        "properties": {"output": {"type": "array", "items": {"type": "string"}}},
        "required": ["output"],
    }
    answer = tool_result(tool, result("stop", "a, b", output=["a", "b"]))
    assert (answer.is_error, answer.structured_content) == (False, {"output": ["a", "b"]})


@pytest.mark.parametrize(
    ("finish_reason", "fields", "says"),
    [
        ("max_iterations", {}, "iteration cap without an answer. Its last words: text"),
        ("cancelled", {"stopped_by": "deadline"}, "cancelled (deadline)"),
        ("error", {"error": TurnError(code="model_unavailable", message="down")}, "down"),
    ],
)
def test_a_turn_that_did_not_answer_is_an_error_result_saying_why(
    finish_reason: str, fields: dict[str, Any], says: str
) -> None:
    answer = tool_result(ExposedTool("support", ""), result(finish_reason, **fields))
    assert answer.is_error
    assert says in answer.content[0].text  # type: ignore[union-attr]
    assert answer.meta == {
        "loopwire/turn_id": "t-1",
        "loopwire/session_id": "s-1",
        "loopwire/finish_reason": finish_reason,
    }


def test_a_budget_answer_is_an_answer_but_structured_output_missing_is_not() -> None:
    assert not tool_result(ExposedTool("support", ""), result("budget")).is_error
    schema = {"type": "object", "properties": {}}
    assert tool_result(ExposedTool("classifier", "", schema), result("stop")).is_error


def test_arguments_that_do_not_fit_say_what_is_wrong() -> None:
    assert parse_arguments({"input": "hi", "session_id": "s-1"}).session_id == "s-1"  # type: ignore[union-attr]
    assert "session_id" in str(parse_arguments({"input": "hi", "session_id": "a.b"}))
    assert "input" in str(parse_arguments({}))
    assert "extra" in str(parse_arguments({"input": "hi", "extra": 1}))


def test_the_agents_file_marks_what_is_exposed(tmp_path: Any) -> None:
    path = tmp_path / "agents.json"
    path.write_text(
        """{"agents": [
        {"name": "a", "description": "A.", "mcp": true},
        {"name": "b", "description": "B.", "mcp": {"description": "Bee."},
         "output_schema": {"type": "object"}},
        {"name": "c", "mcp": false}, {"name": "d"}],
        "workflows": [{"name": "w", "kind": "sequential", "nodes": [{"run": "b"}], "mcp": true}]}"""
    )
    tools = {t.name: t for t in exposed_tools(path)}
    assert sorted(tools) == ["a", "b", "w"]
    assert (tools["a"].description, tools["b"].description) == ("A.", "Bee.")
    assert tools["b"].output_schema == {"type": "object"} and tools["w"].output_schema == {
        "type": "object"
    }
    path.write_text('{"agents": [{"name": "a"}]}')
    with pytest.raises(CliError, match='no agent or workflow is marked "mcp"'):
        exposed_tools(path)
