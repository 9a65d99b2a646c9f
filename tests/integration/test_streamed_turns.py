"""Token streaming over the real worker, broker and Redis, the model streaming server-sent
events through the real ``openai`` client: what a subscriber, the Python client and the CLI
see, a worker killed mid-stream, and a late reader of a step's saved text."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contracts.client import LoopwireClient, new_id
from contracts.events import MessageDelta
from contracts.streaming import StreamText
from contracts.turns import TurnResult
from harness import (
    AMQP_URL,
    REDIS_URL,
    SURVIVOR_ENV,
    CountingToolService,
    EventRecorder,
    WorkerProcess,
    run_past_a_crash,
    session_history,
)
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LONG = " ".join(f"word{i}" for i in range(200))  # about 1,300 characters: ~330 streamed pieces


def streaming_agents(path: Path, tools: list[str], *, stream: bool = True) -> Path:
    agent = {"name": "support", "system_prompt": "Be brief.", "tools": tools, "stream": stream}
    path.write_text(json.dumps({"agents": [agent]}))
    return path


async def collect(handle: object) -> tuple[list[StreamText], TurnResult]:
    pieces: list[StreamText] = []
    async for piece in handle.stream():  # type: ignore[attr-defined]
        if isinstance(piece, TurnResult):
            return pieces, piece
        pieces.append(piece)
    raise AssertionError("the stream ended without a result")


def text_of(pieces: list[StreamText], step: int) -> str:
    """A step's text as a reader shows it: a restarted piece starts the step over."""
    text = ""
    for piece in pieces:
        if piece.step == step:
            text = piece.text if piece.restarted else text + piece.text
    return text


async def test_a_streamed_turn_sends_its_text_in_a_few_deltas_and_saves_the_same_answer(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(
        Reply.tool_calls((lookup.name, {"q": "refund"}), content="Let me look that up.")
    )
    scripted_model.expect(Reply.text(LONG))
    agents = streaming_agents(tmp_path / "agents.json", [lookup.name])
    deltas = EventRecorder("message.delta.#")
    await deltas.start()
    try:
        async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker:
            handle = await client.start_turn("support", "how long do refunds take?")
            pieces, result = await asyncio.wait_for(collect(handle), 30)
            await handle.close()
            # a reader that missed the deltas reads the saved text (a worker answers)
            saved = await client.sessions.text(result.session_id, result.turn_id, 1)
            missing = await client.sessions.text(result.session_id, result.turn_id, 7)
            assert worker.errors() == []
    finally:
        await deltas.stop()

    assert result.finish_reason == "stop"
    assert result.content == LONG
    assert result.usage.completion_tokens > 0  # usage is recorded from the stream's last chunk
    assert text_of(pieces, 0) == "Let me look that up."
    assert text_of(pieces, 1) == LONG
    assert not any(p.restarted for p in pieces)
    # the model was asked to stream, with usage
    for body in scripted_model.requests:
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
    # the tool call was assembled by the worker (the tool ran with its arguments), never published
    assert sum(lookup.executions.values()) == 1
    events = [e for e in deltas.for_turn(result.turn_id)]
    final = sorted((e for e in events if e.step == 1), key=lambda e: e.data.seq)  # type: ignore[union-attr]
    assert all(isinstance(e.data, MessageDelta) for e in events)
    assert "".join(e.data.text for e in final) == LONG  # type: ignore[union-attr]
    assert [e.data.seq for e in final] == list(range(len(final)))  # type: ignore[union-attr]
    assert 2 <= len(final) <= 8, f"{len(final)} publishes for ~330 pieces: not coalesced"
    assert all(e.routing_key == f"message.delta.support.{result.turn_id}" for e in events)
    # saved exactly as without streaming
    history = await session_history(result.session_id)
    assert [m.content for m in history if m.role == "assistant"] == [
        "Let me look that up.",
        LONG,
    ]
    assert saved == LONG
    assert missing is None


async def test_a_request_turns_streaming_on_or_off_whatever_the_profile_says(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    scripted_model.expect(Reply.text("streamed"))
    scripted_model.expect(Reply.text("whole"))
    agents = streaming_agents(tmp_path / "agents.json", [], stream=False)
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents):
        on = await client.start_turn("support", "one", stream=True)
        pieces, result = await asyncio.wait_for(collect(on), 30)
        await on.close()
        off = await client.start_turn("support", "two")
        quiet, whole = await asyncio.wait_for(collect(off), 30)
        await off.close()
    assert "".join(p.text for p in pieces) == "streamed" == result.content
    assert quiet == [] and whole.content == "whole"
    assert scripted_model.requests[0]["stream"] is True
    assert "stream" not in scripted_model.requests[1]


async def test_a_worker_killed_mid_stream_is_followed_by_a_restarted_stream(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    scripted_model.expect(Reply.text(LONG, chunk_delay=0.02))  # ~7 s: the worker dies in it
    scripted_model.expect(Reply.text("The second attempt's answer."))
    agents = streaming_agents(tmp_path / "agents.json", [])
    doomed = WorkerProcess(
        model_url=scripted_model.base_url, agents_file=agents, extra_env={"LOOPWIRE_PREFETCH": "1"}
    )
    survivor = WorkerProcess(
        model_url=scripted_model.base_url, agents_file=agents, extra_env=SURVIVOR_ENV
    )
    await doomed.start()
    try:
        handle = await client.start_turn("support", "tell me everything")
        pieces: list[StreamText] = []
        stream = handle.stream()
        async with asyncio.timeout(30):
            async for piece in stream:
                assert isinstance(piece, StreamText)
                pieces.append(piece)
                if len(pieces) == 3:
                    break
        doomed.kill()
        await survivor.start()
        async with asyncio.timeout(30):
            async for piece in stream:
                if isinstance(piece, TurnResult):
                    result = piece
                    break
                pieces.append(piece)
        await handle.close()
    finally:
        doomed.close()
        survivor.close()
    assert result.content == "The second attempt's answer."
    assert LONG.startswith("".join(p.text for p in pieces[:3]))
    restarted = [p for p in pieces if p.restarted]
    assert len(restarted) == 1
    assert text_of(pieces, 0) == "The second attempt's answer."
    assert survivor.errors() == []


async def test_the_cli_prints_the_answer_as_it_streams(
    scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    scripted_model.expect(Reply.text("Streaming, token by token.", chunk_delay=0.01))
    agents = streaming_agents(tmp_path / "agents.json", [], stream=False)
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents):
        env = {**os.environ, "LOOPWIRE_AMQP_URL": AMQP_URL, "LOOPWIRE_REDIS_URL": REDIS_URL}
        done = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "worker.cli",
                "turn",
                "--stream",
                "-s",
                f"s-{new_id()}",
                "hi",
                "--agent",
                "support",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Streaming, token by token.\n"
    assert scripted_model.requests[0]["stream"] is True


async def test_a_step_redone_after_its_answer_was_saved_streams_the_saved_text_again(
    scripted_model: ScriptedModel,
    lookup: CountingToolService,
    client: LoopwireClient,
    tmp_path: Path,
) -> None:
    scripted_model.expect(
        Reply.tool_calls((lookup.name, {"q": "policy"}), content="Checking the policy.")
    )
    scripted_model.expect(Reply.text("Thirty days."))
    agents = streaming_agents(tmp_path / "agents.json", [lookup.name])
    deltas = EventRecorder("message.delta.#")
    await deltas.start()
    try:
        result, survivor = await run_past_a_crash(
            client, scripted_model.base_url, agents, "model_saved", "support", "refunds?"
        )
        await deltas.wait_for(
            lambda seen: any(e.turn_id == result.turn_id and e.step == 1 for e in seen)
        )
    finally:
        await deltas.stop()
    assert result.content == "Thirty days."
    assert len(scripted_model.requests) == 2  # the saved answer was not asked for again
    assert sum(lookup.executions.values()) == 1
    first = [e.data for e in deltas.for_turn(result.turn_id) if e.step == 0]
    replayed = [d for d in first if isinstance(d, MessageDelta) and d.restarted]
    assert [d.text for d in replayed] == ["Checking the policy."]
    assert survivor.errors() == []
