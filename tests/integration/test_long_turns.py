"""A long turn: 200 tool steps with 16 KB results, through a real worker, RabbitMQ, Redis, a
tool service and the scripted model. Its state stays the size of a short turn's (the bound
in docs/operations.md: a turn's stored state holds its request and counters, never its
completed steps), and every step is recorded once in the turn's step list."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis
from support_rpc import REDIS_URL

from contracts import keys
from contracts.client import LoopwireClient, new_id
from contracts.tools import ToolCallRequest
from harness import CountingToolService, WorkerProcess, session_history, step_records
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration

STEPS = 200
RESULT_CHARS = 16_000
STATE_BOUND = 8 * 1024
"""What docs/operations.md promises of a running turn's stored state with a small request."""


async def test_a_200_step_turn_with_16_kb_results_keeps_its_state_small(
    scripted_model: ScriptedModel, client: LoopwireClient, tmp_path: Path
) -> None:
    async def search(request: ToolCallRequest) -> Any:
        text = f"result {request.arguments.get('q')}: "
        return {"items": [text + "x" * (RESULT_CHARS - len(text) - 16)]}

    service = CountingToolService(f"search_{new_id()[:8]}", search)
    await service.start()
    session = new_id()
    sizes: list[int] = []
    state_key = keys.session_state(session)
    reader = sync_redis.Redis.from_url(REDIS_URL)

    def measure(body: dict[str, Any]) -> None:
        # the state as the step before this model call saved it (the step's record appended
        # beside it), read while the worker waits for this answer
        sizes.append(int(reader.hstrlen(state_key, "s")))
        scripted_model.requests.clear()  # 200 requests of up to 6 MB each: keep none

    for i in range(STEPS):
        scripted_model.expect(Reply.tool_calls((service.name, {"q": f"page {i}"})), check=measure)
    scripted_model.expect(Reply.text("Read all 200 pages."), check=measure)
    agents = tmp_path / "agents.json"
    agents.write_text(
        json.dumps(
            {
                "agents": [
                    {
                        "name": "support",
                        "system_prompt": "You read every page.",
                        "tools": [service.name],
                        "limits": {
                            "max_tool_iterations": 250,
                            "max_tool_result_chars": 20_000,
                            "empty_streak_after": 0,
                        },
                    }
                ]
            }
        )
    )
    try:
        async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker:
            handle = await client.start_turn("support", "read every page", session_id=session)
            result = await handle.result(240)
            await handle.close()
            assert worker.errors() == []
    finally:
        await service.stop()
        reader.close()
    assert (result.finish_reason, result.content, result.steps) == (
        "stop",
        "Read all 200 pages.",
        STEPS + 1,
    )
    assert sum(service.executions.values()) == STEPS
    assert len(sizes) == STEPS + 1
    assert max(sizes) <= STATE_BOUND, f"the state grew to {max(sizes)} bytes"
    assert sizes[-1] - sizes[2] < 256, f"the state grew with the steps: {sizes[2]} -> {sizes[-1]}"
    records = await step_records(session, result.turn_id)
    assert [r.step.index for r in records] == list(range(STEPS + 1))
    history = await session_history(session)
    assert len(history) == 1 + 2 * STEPS + 1
    # each result is in the history once, whole; the record keeps its outcome, not its text
    assert len(history[2].content or "") > RESULT_CHARS - 100
    assert records[0].step.tool_executions[0].content == ""
