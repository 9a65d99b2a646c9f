"""The context budget over the real worker: a worker killed right after it saved a summary
does not make the summary again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contracts.client import LoopwireClient, new_id
from harness import WorkerProcess, run_past_a_crash
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration


async def test_a_summary_is_paid_for_once_when_its_worker_dies(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    plain = tmp_path / "plain.json"
    profile = {"name": "chat", "system_prompt": "agent:chat", "tools": []}
    plain.write_text(json.dumps({"agents": [profile]}))
    agents = tmp_path / "agents.json"
    budget = {"max_tokens": 256, "strategy": "summarize", "keep_last": 2}
    agents.write_text(json.dumps({"agents": [{**profile, "context": budget}]}))
    summaries: list[str] = []

    def answer(body: dict[str, object]) -> Reply:
        messages = body["messages"]  # type: ignore[index]
        if messages[0]["content"] != "agent:chat":  # type: ignore[index]
            summaries.append(messages[-1]["content"])  # type: ignore[index]
            return Reply.text(f"SUMMARY {len(summaries)}")
        return Reply.text("a long answer " + "z" * 300)

    scripted_model.respond_with(answer)
    session = new_id()
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=plain):
        for i in range(3):  # about 420 tokens of history: the next turn needs a summary
            await client.run_turn(
                "chat", f"question {i} " + "q" * 200, session_id=session, timeout=20
            )
    assert not summaries
    result, survivor = await run_past_a_crash(
        client,
        scripted_model.base_url,
        agents,
        "summary_saved",
        "chat",
        "and now?",
        session_id=session,
    )
    assert survivor.errors() == []
    assert result.finish_reason == "stop"
    assert len(summaries) == 1, "the summary was made again"
    last = scripted_model.requests[-1]["messages"]
    assert last[1]["content"] == "Summary of the earlier conversation:\nSUMMARY 1"
