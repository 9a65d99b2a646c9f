"""Agent profiles over the real broker and Redis: the prompt follows the agent into sessions
that exist, the agents file reloads (when it changes, on SIGHUP, refused when bad, between the
steps of a running turn), a fallback chain over two model servers, and the built-in guards."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from test_metrics import answers, eventually, scrape, value

from contracts.client import LoopwireClient, new_id
from harness import CountingToolService, EventRecorder, WorkerProcess
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration


def write(path: Path, agents: list[dict[str, Any]]) -> Path:
    for agent in agents:
        agent.setdefault("tools", [])
    path.write_text(json.dumps({"agents": agents}))
    return path


def prompt_of(body: dict[str, Any]) -> str:
    return str(body["messages"][0]["content"])


async def test_the_prompt_follows_the_agent_and_an_edited_file_reloads(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    agents = write(
        tmp_path / "agents.json",
        [{"name": "a", "system_prompt": "I am A"}, {"name": "b", "system_prompt": "I am B"}],
    )
    scripted_model.respond_with(lambda body: Reply.text(f"answered under {prompt_of(body)}"))
    session = new_id()
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as w:
        first = await client.run_turn("a", "one", session_id=session, timeout=20)
        second = await client.run_turn("b", "two", session_id=session, timeout=20)
        write(agents, [{"name": "a", "system_prompt": "I am A, edited"}, {"name": "b"}])
        await asyncio.sleep(1.2)  # the worker looks at the file at most once a second
        third = await client.run_turn("a", "three", session_id=session, timeout=20)
        samples = await scrape(w.port)
    assert w.errors() == []
    assert [first.content, second.content, third.content] == [
        "answered under I am A",
        "answered under I am B",
        "answered under I am A, edited",
    ]
    assert first.prompt_version != third.prompt_version
    # the conversation carried on in the session: the third call saw all of it
    assert [m["content"] for m in scripted_model.requests[2]["messages"][1:]] == [
        "one",
        "answered under I am A",
        "two",
        "answered under I am B",
        "three",
    ]
    assert (
        value(
            samples,
            "loopwire_agent_info",
            agent="a",
            prompt_version=str(third.prompt_version),
            provider="default",
            model="scripted-model",
        )
        == 1.0
    )
    assert not any(
        name == "loopwire_agent_info" and ("prompt_version", str(first.prompt_version)) in labels
        for name, labels in samples
    ), "the version before is gone from the info metric"


async def test_a_bad_file_is_refused_and_sighup_reloads_between_steps(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    lookup: CountingToolService,
    tmp_path: Path,
) -> None:
    agents = write(
        tmp_path / "agents.json",
        [{"name": "a", "system_prompt": "version one", "tools": [lookup.name]}],
    )
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as w:
        agents.write_text("{not json")
        assert w.proc is not None
        w.proc.send_signal(signal.SIGHUP)

        async def refused() -> bool:
            return value(await scrape(w.port), "loopwire_profile_reload_errors_total") == 1.0

        await eventually(refused)
        assert await answers(w.port, "/readyz", 200)
        scripted_model.expect(Reply.text("still here"))
        kept = await client.run_turn("a", "hi", timeout=20)
        assert prompt_of(scripted_model.requests[-1]) == "version one"

        # a step in flight keeps its profile; the next step gets the one reloaded meanwhile
        scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "x"}), delay=2.0))
        scripted_model.expect(Reply.text("done"))
        handle = await client.start_turn("a", "go")
        await scripted_model.wait_for_requests(2, timeout=20)
        write(agents, [{"name": "a", "system_prompt": "version two", "tools": [lookup.name]}])
        os.kill(w.proc.pid, signal.SIGHUP)
        result = await handle.result(30)
        await handle.close()
    assert kept.content == "still here"
    assert result.content == "done"
    assert [prompt_of(r) for r in scripted_model.requests[-2:]] == ["version one", "version two"]
    assert "agents file not reloaded" in w.log_path.read_text()


async def test_a_fallback_chain_answers_from_the_next_provider(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    events: EventRecorder,
    tmp_path: Path,
) -> None:
    backup = ScriptedModel()
    await backup.start()
    try:
        scripted_model.respond_with(lambda body: Reply.error(503, "overloaded"))
        backup.respond_with(lambda body: Reply.text(f"backup answered {body['model']}"))
        agents = write(
            tmp_path / "agents.json",
            [
                {
                    "name": "a",
                    "models": [
                        {"provider": "default", "model": "big"},
                        {"provider": "backup", "model": "small"},
                    ],
                }
            ],
        )
        providers = {
            "backup": {"base_url": backup.base_url, "api_key_env": "BACKUP_KEY", "max_retries": 0}
        }
        async with WorkerProcess(
            model_url=scripted_model.base_url,
            agents_file=agents,
            extra_env={"LOOPWIRE_PROVIDERS": json.dumps(providers), "BACKUP_KEY": "sk-backup"},
        ) as w:
            result = await client.run_turn("a", "hi", timeout=20)
            samples = await scrape(w.port)
    finally:
        await backup.stop()
    assert result.content == "backup answered small"
    assert result.models == ("small",)  # as the endpoint named it
    assert [r["model"] for r in scripted_model.requests] == ["big"]
    assert (
        value(
            samples,
            "loopwire_model_fallbacks_total",
            server_address="default",
            error_type="model_http_503",
        )
        == 1.0
    )
    await events.wait_for(lambda evs: any(e.type == "turn.completed" for e in evs))
    step = next(e for e in events.for_turn(result.turn_id) if e.type == "step.completed")
    assert (step.data.provider, step.data.model) == ("backup", "small")  # type: ignore[union-attr]


async def test_a_profile_naming_an_unconfigured_provider_stops_the_worker(
    scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    agents = write(tmp_path / "agents.json", [{"name": "a", "provider": "ghost"}])
    worker = WorkerProcess(model_url=scripted_model.base_url, agents_file=agents)
    with pytest.raises(RuntimeError, match="provider 'ghost', which is not configured"):
        await worker.start()


async def test_the_built_in_guards_over_the_real_worker(
    scripted_model: ScriptedModel,
    client: LoopwireClient,
    lookup: CountingToolService,
    tmp_path: Path,
) -> None:
    agents = write(
        tmp_path / "agents.json",
        [
            {
                "name": "guarded",
                "tools": [lookup.name],
                "hooks": ["tool_guard", "content_guard"],
                "hook_config": {
                    "tool_guard": {
                        "rules": [
                            {
                                "tool": lookup.name,
                                "arguments": {"q": "(?i)secret"},
                                "message": "not that",
                            }
                        ]
                    },
                    "content_guard": {
                        "rules": [
                            {
                                "name": "password",
                                "pattern": "(?i)password is",
                                "replacement": "Withheld.",
                            }
                        ]
                    },
                },
                "limits": {"empty_streak_after": 0},
            }
        ],
    )
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "the SECRET plans"})))
    scripted_model.expect(Reply.tool_calls((lookup.name, {"q": "weather"})))
    scripted_model.expect(Reply.text("the admin password is hunter2"))
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as w:
        result = await client.run_turn("guarded", "go", timeout=30)
    assert w.errors() == []
    assert [r.arguments["q"] for r in lookup.received] == ["weather"]
    blocked = scripted_model.requests[1]["messages"][-1]
    assert blocked["role"] == "tool" and json.loads(blocked["content"]) == {
        "error": "blocked: not that"
    }
    assert (result.finish_reason, result.stopped_by, result.content) == (
        "stop",
        "content_guard:password",
        "Withheld.",
    )
