"""Outages while a real example tool runs: Redis paused for 8 s (``CLIENT PAUSE``), and the
broker's app stopped for 8 s and started again, with the idempotent calculator and the
non-idempotent notes service.

What must hold: the call that ran is answered with its real result (re-sent with its
idempotency key when the step is redone, answered from the service's stored reply); the
model is still offered the tool afterwards; every call ran exactly once; the turn's answer is
the model's. The broker is a node of this module's own, so stopping it touches nothing else.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from nodes import RabbitNode
from redis.asyncio import Redis

from contracts import keys
from contracts.client import LoopwireClient, new_id
from contracts.codec import decode_obj
from harness import WorkerProcess, session_history, write_agents
from tool_services.calculator.service import create_service as calculator
from tool_services.notes.service import create_service as notes
from tool_services.sdk import CallContext, ToolService
from tool_services.server import ToolServer
from tool_services.settings import Settings, ToolServiceSettings
from worker.testing.scripted_model import Reply, ScriptedModel

pytestmark = pytest.mark.integration

OUTAGE_S = 8

# example -> (service factory, tool, arguments of the first and second call)
EXAMPLES: dict[str, tuple[Callable[[], ToolService], str, dict[str, Any], dict[str, Any]]] = {
    "calculator": (calculator, "calculate", {"expression": "2**10"}, {"expression": "3*7"}),
    "notes": (notes, "file_note", {"text": "refund approved"}, {"text": "customer called"}),
}


@pytest.fixture(scope="module")
def rabbit() -> Iterator[RabbitNode]:
    node = RabbitNode()
    try:
        node.start()
        yield node
    finally:
        node.close()


def with_outage(
    example: ToolService, tool: str, name: str, outage: Callable[[], Awaitable[None]]
) -> tuple[ToolService, list[str], list[asyncio.Task[None]]]:
    """The example's tool under a test's own name. Its first execution starts the outage (in
    a task of the test's: the tool's own may be cancelled when the broker goes) and finishes
    while it lasts. Returns the service, the call ids it executed, and the outage's task."""
    original = example.tools[tool]
    runs: list[str] = []
    outages: list[asyncio.Task[None]] = []

    async def run(args: Any, ctx: CallContext) -> Any:
        runs.append(ctx.call_id)
        if len(runs) == 1:
            outages.append(asyncio.create_task(outage()))
            await asyncio.sleep(1.0)  # the outage has begun
        return await original.fn(args, ctx)

    service = ToolService(f"{example.name}-{uuid.uuid4().hex[:8]}")
    service.add_tool(
        run,
        name=name,
        description=original.definition.description,
        timeout_s=original.timeout_s,
        idempotent=original.idempotent,
        args_model=original.args_model,
    )
    return service, runs, outages


def offered(request: dict[str, Any]) -> list[str]:
    return [t["function"]["name"] for t in request.get("tools", [])]


def tool_results(request: dict[str, Any]) -> list[Any]:
    return [json.loads(m["content"]) for m in request["messages"] if m["role"] == "tool"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("outage", ["redis", "broker"])
@pytest.mark.parametrize("example", ["calculator", "notes"])
async def test_an_outage_while_a_tool_runs_leaves_the_tool_live_and_runs_nothing_twice(
    outage: str,
    example: str,
    rabbit: RabbitNode,
    private_redis: tuple[str, Any],
    scripted_model: ScriptedModel,
    tmp_path: Path,
) -> None:
    redis_url, _ = private_redis
    redis = Redis.from_url(redis_url)
    pauser = Redis.from_url(redis_url)

    async def pause_redis() -> None:
        await pauser.execute_command("CLIENT", "PAUSE", str(OUTAGE_S * 1000), "ALL")

    async def restart_broker() -> None:
        started = time.monotonic()
        await asyncio.to_thread(rabbit.stop_app)
        print(f"broker app stopped after {time.monotonic() - started:.1f}s")
        await asyncio.sleep(OUTAGE_S)
        await asyncio.to_thread(rabbit.start_app)
        print(f"broker app started again after {time.monotonic() - started:.1f}s")

    factory, tool, first_args, second_args = EXAMPLES[example]
    name = f"{tool}_{uuid.uuid4().hex[:8]}"
    service, runs, outages = with_outage(
        factory(), tool, name, pause_redis if outage == "redis" else restart_broker
    )
    server = ToolServer(
        service, Settings(amqp_url=rabbit.url, redis_url=redis_url, tools=ToolServiceSettings())
    )
    await server.start()
    scripted_model.expect(Reply.tool_calls((name, first_args)))
    scripted_model.expect(Reply.tool_calls((name, second_args)))
    scripted_model.expect(Reply.text("all done"))
    worker = WorkerProcess(
        model_url=scripted_model.base_url,
        agents_file=write_agents(tmp_path / "agents.json", [name]),
        redis_url=redis_url,
        extra_env={"LOOPWIRE_AMQP_URL": rabbit.url, "LOOPWIRE_REDIS_TIMEOUT_S": "1"},
    )
    session = new_id()
    try:
        await worker.start()
        async with LoopwireClient(rabbit.url) as client:
            handle = await client.start_turn("support", "go", session_id=session)
            result = await handle.result(120)
            await handle.close()
        history = await session_history(session, redis_url)
        filed = [decode_obj(n) for n in await redis.lrange(keys.session_notes(session), 0, -1)]
    finally:
        for task in outages:
            await task  # the broker is back whatever happened
        worker.close()
        await server.stop()
        await redis.aclose()
        await pauser.aclose()

    assert result.finish_reason == "stop"
    assert result.content == "all done"
    assert len(scripted_model.requests) == 3, "no model call was made twice or for a lost tool"
    second, third = scripted_model.requests[1], scripted_model.requests[2]
    assert offered(second) == [name] and offered(third) == [name], "the live tool stays offered"
    answers = tool_results(third)
    assert len(answers) == 2 and not any("error" in a for a in answers), answers
    if example == "calculator":
        assert [a["value"] for a in answers] == ["1024", "21"]
    else:
        assert [(a["filed"], a["count"]) for a in answers] == [(True, 1), (True, 2)]
        assert [n["text"] for n in filed] == ["refund approved", "customer called"]
    assert len(runs) == len(set(runs)) == 2, f"each call ran once: {runs}"
    roles = ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [m.role for m in history] == roles
