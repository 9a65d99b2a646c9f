"""A ``persist: false`` turn over the real Redis, ended in every way a turn ends: it leaves no
message list of its own behind, and no key of its session without an expiry."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import httpx2
import openai
import pytest
from redis.asyncio import Redis

from contracts import keys
from contracts.tools import ToolDefinition
from contracts.turns import InputMessage, LimitOverrides, TurnRequest, TurnResult
from contracts.work import StepWork
from worker.loop import Hook, HookContext
from worker.model.adapter import OpenAIModel
from worker.model.http import ModelHttpClient
from worker.sequencing.actions import Action, Step
from worker.sequencing.sequencer import SessionSequencer
from worker.session.store import RedisStore
from worker.testing.memory import FunctionTools, ListSink
from worker.testing.replies import Reply
from worker.testing.scripted_model import ScriptedModel
from worker.testing.sequencing import sequencer_over

LOOKUP = ToolDefinition(name="lookup", description="look up", parameters={"type": "object"})


class StopAtSecondStep(Hook):
    name = "stopper"

    async def before_step(self, ctx: HookContext) -> None:
        if ctx.step == 1:
            ctx.stop(self.name, "enough")


async def echo(arguments: dict[str, object], _context: object) -> dict[str, object]:
    return {"results": [arguments]}


@pytest.fixture
async def model(scripted_model: ScriptedModel) -> AsyncIterator[OpenAIModel]:
    client = openai.AsyncOpenAI(
        base_url=scripted_model.base_url,
        api_key="test",
        max_retries=0,
        http_client=ModelHttpClient(timeout=httpx2.Timeout(30, connect=5)),
    )
    try:
        yield OpenAIModel(client, model="scripted-model", bad_response_retries=0)
    finally:
        await client.close()


@pytest.fixture
def sequencer(redis: Redis, model: OpenAIModel) -> Callable[[Hook], SessionSequencer]:
    def build(hooks: Hook) -> SessionSequencer:
        return sequencer_over(
            RedisStore(redis, ttl_s=3600),
            model=model,
            tools=FunctionTools({"lookup": echo}),
            definitions=[LOOKUP],
            events=ListSink(),
            hooks=hooks,
        )

    return build


def request(
    uid: str, case: str, *, cap: int | None = None, deadline: float | None = None
) -> TurnRequest:
    return TurnRequest(
        turn_id=f"t-{uid}-{case}",
        session_id=f"s-{uid}-{case}",
        agent="support",
        input=(InputMessage(content="look it up"),),
        persist=False,
        limits=LimitOverrides(max_tool_iterations=cap),
        deadline=deadline,
    )


async def run(seq: SessionSequencer, turn: TurnRequest, *, steps: int | None = None) -> None:
    """Accept the turn and run its steps as the consumer would (``steps``: stop after so many)."""
    actions: list[Action] = await seq.on_request(turn)
    done = 0
    while (work := next((a.work for a in actions if isinstance(a, Step)), None)) is not None:
        if steps is not None and done == steps:
            return
        actions = await seq.on_step(work)
        done += 1


async def ended(redis: Redis, seq: SessionSequencer, turn: TurnRequest) -> TurnResult:
    result = await seq.store.result(turn.session_id, turn.turn_id)
    assert result is not None, "the turn has a stored result"
    names = [key async for key in redis.scan_iter(match=f"lw:{{{turn.session_id}}}:*")]
    assert names, "the session has keys"
    assert not [n for n in names if b":messages" in n], "the turn's own message list is gone"
    without_ttl = [n for n in names if await redis.ttl(n) < 0]
    assert without_ttl == [], "every key of the session expires"
    assert await redis.llen(f"lw:{{{turn.session_id}}}:history") == 0, "no history written"
    # the turn's step records stay, with the session's expiry: one for each step it completed
    steps = keys.turn_steps(turn.session_id, turn.turn_id)
    assert await redis.llen(steps) == result.steps
    if result.steps:
        assert 3600 - 5 <= await redis.ttl(steps) <= 3600
    return result


def lookup(n: int) -> Reply:
    return Reply.tool_calls(("lookup", {"q": n}))


async def test_answered(
    redis: Redis,
    uid: str,
    scripted_model: ScriptedModel,
    sequencer: Callable[[Hook], SessionSequencer],
) -> None:
    seq = sequencer(Hook())
    scripted_model.expect(lookup(1))
    scripted_model.expect(Reply.text("the answer"))
    turn = request(uid, "answered")
    await run(seq, turn)
    result = await ended(redis, seq, turn)
    assert (result.finish_reason, result.content) == ("stop", "the answer")


async def test_iteration_cap(
    redis: Redis,
    uid: str,
    scripted_model: ScriptedModel,
    sequencer: Callable[[Hook], SessionSequencer],
) -> None:
    seq = sequencer(Hook())
    scripted_model.expect(lookup(1))
    turn = request(uid, "cap", cap=1)
    await run(seq, turn)
    assert (await ended(redis, seq, turn)).finish_reason == "max_iterations"


async def test_a_hook_stop(
    redis: Redis,
    uid: str,
    scripted_model: ScriptedModel,
    sequencer: Callable[[Hook], SessionSequencer],
) -> None:
    seq = sequencer(StopAtSecondStep())
    scripted_model.expect(lookup(1))
    turn = request(uid, "stopped")
    await run(seq, turn)
    result = await ended(redis, seq, turn)
    assert (result.finish_reason, result.stopped_by) == ("stop", "stopper")


async def test_the_deadline(
    redis: Redis, uid: str, sequencer: Callable[[Hook], SessionSequencer]
) -> None:
    seq = sequencer(Hook())
    turn = request(uid, "late", deadline=time.time() - 1)
    await run(seq, turn)
    assert (await ended(redis, seq, turn)).finish_reason == "cancelled"


async def test_a_failed_model_call(
    redis: Redis,
    uid: str,
    scripted_model: ScriptedModel,
    sequencer: Callable[[Hook], SessionSequencer],
) -> None:
    seq = sequencer(Hook())
    scripted_model.expect(lookup(1))
    scripted_model.expect(Reply.error(500))
    turn = request(uid, "model-error")
    await run(seq, turn)
    result = await ended(redis, seq, turn)
    assert result.finish_reason == "error"
    assert result.error is not None and result.error.code == "model_http_500"


@pytest.mark.parametrize("code", ["step_failed", "poison"])
@pytest.mark.parametrize("started", [True, False])
async def test_a_step_that_can_never_succeed(
    redis: Redis,
    uid: str,
    scripted_model: ScriptedModel,
    sequencer: Callable[[Hook], SessionSequencer],
    code: str,
    started: bool,
) -> None:
    seq = sequencer(Hook())
    turn = request(uid, f"{code}-{started}")
    if started:
        scripted_model.expect(lookup(1))
    await run(seq, turn, steps=1 if started else 0)
    work = StepWork(session_id=turn.session_id, turn_id=turn.turn_id, step=1 if started else 0)
    await seq.fail_turn(work, code, "it keeps failing")
    result = await ended(redis, seq, turn)
    assert result.finish_reason == "error"
    assert result.error is not None and result.error.code == code
    assert result.steps == (1 if started else 0)
