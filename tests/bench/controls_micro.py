"""What the turn controls add to a step when none is configured, measured alone in the driver
process (``time.process_time`` per step): the loop's checks (is a budget set, does a call
need approval, does a hook ask for one, is the turn parked) and the lease script reading the
turn's controls (an empty hash) beside the state, against the script without that read (the
script as it is now also keeps the session's keys alive, which counts here too)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from redis.asyncio import Redis

from contracts import keys
from contracts.messages import ChatMessage, ToolCall
from contracts.state import ModelResponse, PendingStep
from contracts.turns import InputMessage, TurnRequest
from worker.loop.approvals import undecided
from worker.loop.budgets import configured
from worker.loop.hooks import Hooks, asks_approval
from worker.loop.spec import AgentSpec
from worker.loop.turn import new_execution, with_execution
from worker.session import scripts
from worker.session.handle import _parked_arg

BEGIN_BEFORE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {0} end
local token = redis.call('INCR', KEYS[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('SET', KEYS[1], token, 'PX', ARGV[1])
local state = redis.call('HMGET', KEYS[3], 'v', 's')
return {token, state[1] or false, state[2] or false, table.concat(redis.call('LRANGE', KEYS[4], 0, -1))}
"""
"""The lease script before the turn controls."""


def _checks_us(n: int) -> float:
    agent = AgentSpec(name="support")
    request = TurnRequest(
        turn_id="t1", session_id="s1", agent="support", input=(InputMessage(content="hi"),)
    )
    state = new_execution(None, request, agent, time.time())
    call = ToolCall(id="c1", name="calculate", arguments=json.dumps({"expression": "1+1"}))
    answer = ModelResponse(message=ChatMessage(role="assistant", tool_calls=(call,)))
    state = with_execution(state, pending=PendingStep(index=0, started_at=0.0, response=answer))
    ex = state.execution
    assert ex is not None and ex.pending is not None
    hooks = Hooks()
    started = time.process_time()
    for _ in range(n):
        configured(agent, ex)
        undecided(ex.pending, agent, frozenset())
        asks_approval(hooks)
        _parked_arg(state, None)
        _parked_arg(state, None)
    return (time.process_time() - started) / n * 1e6


async def _script_us(redis: Redis, script: str, n: int, controls: bool) -> float:
    session = f"bench-{uuid.uuid4().hex[:8]}"
    run = redis.register_script(script)
    names = [
        keys.session_lease(session),
        keys.session_fence(session),
        keys.session_state(session),
        keys.session_history(session),
    ]
    if controls:  # the lease script as it is: it also keeps the session's keys alive
        names += [
            keys.turn_controls(session, "t1"),
            keys.session_queue(session),
            keys.session_requests(session),
            keys.session_turns(session),
            keys.session_replies(session),
            keys.turn_steps(session, "t1"),
        ]
    await redis.hset(keys.session_state(session), mapping={"v": 3, "s": b"x" * 3000})
    await redis.rpush(keys.session_history(session), *([b"m" * 500] * 40))
    try:
        await run(keys=names, args=[15000, 3600, ""])  # loaded
        started = time.process_time()
        for _ in range(n):
            await redis.delete(names[0])
            await run(keys=names, args=[15000, 3600, ""])
        return (time.process_time() - started) / n * 1e6
    finally:
        await redis.delete(*names)


async def unused_controls(redis: Redis, n: int) -> dict[str, Any]:
    checks = _checks_us(n * 10)
    before = after = 0.0
    for _ in range(3):  # alternated, the lowest of each kept
        b = await _script_us(redis, BEGIN_BEFORE, n, controls=False)
        a = await _script_us(redis, scripts.BEGIN, n, controls=True)
        before = b if not before else min(before, b)
        after = a if not after else min(after, a)
    return {
        "checks_us_per_step": checks,
        "lease_script_us_before": before,
        "lease_script_us_after": after,
        "added_us_per_step": checks + max(0.0, after - before),
    }
