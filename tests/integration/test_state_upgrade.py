"""A turn that a worker of the release before step lists started is finished by a worker of
this one. ``data/state_with_inline_steps.json`` holds the session's keys as that release wrote
them (commit f63c9bb, its in-process sequencer over the Redis store): a turn of ``support``
whose first step called ``lookup`` and completed (its record inline in the state, under
``execution.steps``), then stopped before its second step. Its step records are read, the
inline one first."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from redis.asyncio import Redis
from support_rpc import wait_until

from contracts import keys
from contracts import topology as t
from contracts.client import LoopwireClient
from contracts.codec import encode, read_stored
from contracts.sessions import SessionQuery
from contracts.state import AgentState, StepExecution
from contracts.turns import TurnResult
from contracts.work import StepWork
from harness import WorkerProcess, session_history, step_records, write_agents
from worker.session.records import SessionRecords
from worker.session.store import RedisStore
from worker.testing.scripted_model import Reply, ScriptedModel
from worker.transport.session_reads import answer

pytestmark = pytest.mark.integration

DATA = Path(__file__).parent / "data" / "state_with_inline_steps.json"
SESSION, TURN = "legacy-s1", "legacy-t1"


def _value(entry: dict[str, str]) -> bytes:
    return entry["text"].encode() if "text" in entry else base64.b64decode(entry["base64"])


async def restore(redis: Redis) -> None:
    """The session's keys as the earlier release left them (living an hour)."""
    stored: dict[str, Any] = json.loads(DATA.read_text())
    await redis.delete(*stored, keys.turn_steps(SESSION, TURN), keys.turn_result(SESSION, TURN))
    for key, item in stored.items():
        kind, value = item["type"], item["value"]
        if kind == "string":
            await redis.set(key, _value(value))
        elif kind == "hash":
            await redis.hset(key, mapping={f: _value(v) for f, v in value.items()})
        elif kind == "list":
            await redis.rpush(key, *(_value(v) for v in value))
        elif kind == "set":
            await redis.sadd(key, *value)
        await redis.expire(key, 3600)


async def test_a_turn_started_with_inline_step_records_is_finished_by_this_release(
    scripted_model: ScriptedModel, client: LoopwireClient, redis: Redis, tmp_path: Path
) -> None:
    await restore(redis)
    before = read_stored(await redis.hget(keys.session_state(SESSION), "s"), AgentState)
    ex = before.execution
    assert ex is not None and len(ex.steps) == 1  # as the earlier release kept it
    assert (ex.step_count, ex.tool_calls) == (1, 1)  # counted from the inline record

    scripted_model.expect(Reply.text("Refunds take 5 days."))
    agents = write_agents(tmp_path / "agents.json", ["lookup"])
    store = RedisStore(redis)
    async with WorkerProcess(model_url=scripted_model.base_url, agents_file=agents) as worker:
        # the second step's message, as the earlier worker would have published it
        await client.channel.default_exchange.publish(
            aio_pika.Message(
                encode(StepWork(session_id=SESSION, turn_id=TURN, step=1)),
                headers={t.H_KIND: t.KIND_STEP},
            ),
            routing_key=t.TURNS_QUEUE,
        )
        await wait_until(lambda: store.result(SESSION, TURN), timeout=30)
        assert worker.errors() == []
    result = await store.result(SESSION, TURN)
    assert isinstance(result, TurnResult)
    assert (result.finish_reason, result.content, result.steps) == (
        "stop",
        "Refunds take 5 days.",
        2,
    )
    assert result.models[0] == "legacy-model" and len(result.models) == 2
    assert result.usage.total_tokens > 25  # the first step's tokens, and the second's
    # the model saw the first step's call and result, from the history the earlier release wrote
    sent = scripted_model.requests[0]["messages"]
    assert [m["role"] for m in sent][-3:] == ["user", "assistant", "tool"]
    history = await session_history(SESSION)
    assert [m.role for m in history] == ["user", "assistant", "tool", "assistant"]
    # the step this release completed is in the turn's step list; the inline one stayed inline
    records: list[StepExecution] = await step_records(SESSION, TURN)
    assert [r.step.index for r in records] == [1]
    assert await SessionRecords(redis).step_text(SESSION, TURN, 1) == "Refunds take 5 days."


async def test_the_step_records_a_turn_kept_inline_are_read_before_its_step_list(
    redis: Redis,
) -> None:
    await restore(redis)
    records = SessionRecords(redis)
    state = read_stored(await redis.hget(keys.session_state(SESSION), "s"), AgentState)
    assert state.execution is not None
    inline = state.execution.steps[0]
    # a step this release completed next, while the turn still runs: in the turn's step list
    later = StepExecution(
        step=inline.step.model_copy(update={"index": 1}), started_at=5.0, completed_at=6.0
    )
    await redis.rpush(keys.turn_steps(SESSION, TURN), encode(later.stored()))

    def read(offset: int, limit: int) -> SessionQuery:
        return SessionQuery(op="steps", turn_id=TURN, offset=offset, limit=limit)

    both, first, second = [await answer(records, read(o, n)) for o, n in ((0, 100), (0, 1), (1, 5))]
    assert [(r.ok, r.total) for r in (both, first, second)] == [(True, 2)] * 3
    assert [r.step.index for r in both.steps] == [0, 1]
    assert first.steps == (inline.stored(),) and second.steps == (later.stored(),)
    assert both.steps[0].step.output_messages == ()  # as the step list keeps a record
    await redis.delete(keys.turn_steps(SESSION, TURN))
