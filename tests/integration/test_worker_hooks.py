"""Hook sets enabled by import path in a real worker: a failing ``after_tool`` hook and stops
from ``prepare_messages`` and ``after_tool``, as a publisher and the model see them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from contracts.client import LoopwireClient
from harness import (
    CountingToolService,
    EventRecorder,
    WorkerProcess,
    assert_valid_transcript,
    session_history,
)
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration

HOOKS = "tests.hook_fixtures.hooks"


def worker_with_hooks(
    tmp_path: Path, model: ScriptedModel, tool: str, hook: str, config: dict[str, Any] | None
) -> WorkerProcess:
    agent: dict[str, Any] = {"name": "support", "tools": [tool], "hooks": [f"{HOOKS}:{hook}"]}
    if config is not None:
        agent["hook_config"] = {f"{HOOKS}:{hook}": config}
    path = tmp_path / "agents.json"
    path.write_text(json.dumps({"agents": [agent]}))
    return WorkerProcess(model_url=model.base_url, agents_file=path)


def tool_contents(request: dict[str, Any]) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "tool"]


async def test_a_failing_after_tool_hook_withholds_the_result_and_the_turn_goes_on(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refunds"})))
    scripted_model.expect(Reply.text("I could not read the result."))
    async with worker_with_hooks(
        tmp_path, scripted_model, lookup.name, "FailingAfterTool", None
    ) as worker:
        result = await client.run_turn("support", "refunds?", timeout=30)
    assert result.finish_reason == "stop"
    assert result.content == "I could not read the result."
    assert sum(lookup.executions.values()) == 1, "the tool ran once; the step was not redone"
    # the model never saw the unchecked result, only that a hook failed
    [seen] = tool_contents(scripted_model.requests[1])
    assert json.loads(seen) == {"error": "result withheld: a hook failed"}
    assert "found refunds" not in json.dumps(scripted_model.requests[1])
    await events.wait_for(lambda evs: any(e.type == "turn.completed" for e in evs))
    [invoked] = [e for e in events.for_turn(result.turn_id) if e.type == "tool.invoked"]
    assert invoked.data.outcome == "error"  # type: ignore[union-attr]
    assert any("after_tool hook failed" in line for line in worker.errors())


async def test_a_stop_from_prepare_messages_ends_the_turn_before_the_next_model_call(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    events: EventRecorder,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "refunds"}), content="checking"))
    config = {"point": "prepare_messages", "step": 1, "reason": "input judged unsafe"}
    async with worker_with_hooks(tmp_path, scripted_model, lookup.name, "StopAt", config) as worker:
        result = await client.run_turn("support", "refunds?", timeout=30)
    assert worker.errors() == []
    assert len(scripted_model.requests) == 1, "the model is not called for the stopped step"
    assert sum(lookup.executions.values()) == 1
    assert (result.finish_reason, result.stopped_by) == ("stop", "stop_at")
    assert result.content == "checking"
    assert result.steps == 1
    await events.wait_for(lambda evs: any(e.type == "turn.completed" for e in evs))
    types = [e.type for e in events.for_turn(result.turn_id)]
    assert types[-2:] == ["step.completed", "turn.completed"]
    assert types.count("step.completed") == 1


async def test_a_stop_from_after_tool_lets_the_step_finish_and_ends_the_turn(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(
        Reply.tool_calls(
            (lookup.name, {"q": "refunds"}), (lookup.name, {"q": "returns"}), content="checking"
        )
    )
    config = {"point": "after_tool", "reason": "enough found"}
    async with worker_with_hooks(tmp_path, scripted_model, lookup.name, "StopAt", config) as worker:
        result = await client.run_turn("support", "refunds?", timeout=30)
    assert worker.errors() == []
    assert len(scripted_model.requests) == 1
    assert sum(lookup.executions.values()) == 2, "both calls of the step ran"
    assert (result.finish_reason, result.stopped_by, result.content) == (
        "stop",
        "stop_at",
        "checking",
    )
    history = await session_history(result.session_id)
    assert [m.role for m in history] == ["user", "assistant", "tool", "tool"]
    assert_valid_transcript(history)


async def test_a_hook_set_that_does_not_import_stops_the_worker_at_start(
    scripted_model: ScriptedModel, lookup: CountingToolService, tmp_path: Path
) -> None:
    worker = worker_with_hooks(tmp_path, scripted_model, lookup.name, "NoSuchHook", None)
    with pytest.raises(RuntimeError, match="worker exited") as exited:
        await worker.start()
    assert f"agent 'support', hook set '{HOOKS}:NoSuchHook'" in str(exited.value)
    assert worker.proc is not None and worker.proc.returncode == 2
