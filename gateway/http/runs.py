"""Runs: a run is a turn, published through the publisher client for the request's tenant,
in the thread's session.

- ``start``: the request's checks (the assistant, the input, ``multitask_strategy``: ``enqueue``
  waits behind the thread's running run, ``reject`` refuses while one runs, ``interrupt``
  cancels it first, ``rollback`` cancels it and removes its messages from the thread: the
  session runs the new turn once the cancelled one has ended, so it sees the thread as the
  cancel left it), then the turn, published; the handle follows its events.
- ``subscribed``: the run's events from now on (``streams.py`` makes them a stream).
- ``follow``: the end of a run started elsewhere (another request, another replica): its
  events are subscribed to before its stored result is read, so an end between the two is
  not missed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from contracts.client import LoopwireClient, TurnHandle
from contracts.events import Event
from contracts.history import read_history
from contracts.messages import ChatMessage
from contracts.turns import TurnResult
from gateway.http import approvals, shapes
from gateway.http.errors import RunError

FINAL_EVENTS = frozenset({"turn.completed", "turn.failed", "turn.cancelled", "turn.rejected"})
STREAM_MODES = frozenset({"values", "updates", "messages-tuple", "messages"})
STRATEGIES = ("enqueue", "reject", "interrupt", "rollback")
PAGE = 1000


async def whole_history(redis: Redis, thread_id: str) -> list[ChatMessage]:
    """The thread's messages, read from Redis as the workers store them (contracts.history):
    one round trip, not a session read through the fleet."""
    return await read_history(redis, thread_id)


def stream_modes(raw: Any) -> frozenset[str]:
    modes = [raw] if isinstance(raw, str) else list(raw or ["values"])
    unknown = [m for m in modes if m not in STREAM_MODES]
    if unknown:
        raise RunError(422, f"stream_mode {unknown[0]!r} is not one of {sorted(STREAM_MODES)}")
    return frozenset(modes)


async def start(
    client: LoopwireClient,
    thread_id: str,
    body: dict[str, Any],
    assistants: Sequence[str],
    turn_id: str | None = None,
) -> TurnHandle:
    assistant = body.get("assistant_id")
    if assistant not in assistants:
        raise RunError(404, f"no assistant {str(assistant)[:100]!r}")
    strategy = body.get("multitask_strategy") or "enqueue"
    if strategy not in STRATEGIES:
        raise RunError(
            422, f"multitask_strategy {strategy!r} is not supported (one of {STRATEGIES})"
        )
    try:
        texts = shapes.input_texts(body.get("input"))
    except ValueError as exc:
        raise RunError(422, str(exc)) from None
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise RunError(422, "metadata must be an object")
    if strategy != "enqueue":
        summary = await client.sessions.get(thread_id)
        running = summary.running if summary is not None else None
        if running is not None and strategy == "reject":
            raise RunError(409, f"thread {thread_id} has a run in progress ({running})")
        if running is not None:  # it ends (its messages kept, or not); the new run follows
            await client.cancel(
                running,
                "interrupted by a new run"
                if strategy == "interrupt"
                else "rolled back for a new run",
                session_id=thread_id,
                rollback=strategy == "rollback",
            )
    wants_text = "messages-tuple" in stream_modes(body.get("stream_mode")) or None
    return await client.start_turn(
        str(assistant),
        texts,
        session_id=thread_id,
        turn_id=turn_id,
        metadata=metadata,
        stream=wants_text,
    )


@contextlib.asynccontextmanager
async def subscribed(client: LoopwireClient, run_id: str) -> AsyncIterator[AsyncIterator[Event]]:
    """The run's events from now on (bound before this yields), within the call's tenant (the
    tenant's client), on the client's one reply queue (``contracts.replies``)."""
    async with client.watching(run_id) as events:
        yield events


async def follow(
    client: LoopwireClient, thread_id: str, run_id: str, timeout_s: float
) -> TurnResult | None:
    """The run's result once it ends (None: no such run in the thread)."""
    async with subscribed(client, run_id) as events:
        if await client.sessions.turn(run_id, thread_id) is None:
            return None
        result = await client.sessions.result(run_id, thread_id)
        if result is not None:
            return result
        async with asyncio.timeout(timeout_s):
            async for event in events:
                if event.type in FINAL_EVENTS:
                    break
        return await client.sessions.result(run_id, thread_id)


@dataclass(slots=True)
class Following:
    """A run the request follows: its events from before anything it sent, its result once it
    ends, and what to let go of after."""

    run_id: str
    thread_id: str
    assistant_id: str
    events: AsyncIterator[Event]
    result: Callable[[], Awaitable[TurnResult | None]]
    close: Callable[[], Awaitable[None]]
    answered_directly: bool = False
    """``result()`` resolves as soon as the run's result reaches the client's reply queue
    (a run it published), not only after the run's final event."""

    @classmethod
    def of(cls, handle: TurnHandle, assistant_id: str) -> Following:
        async def result() -> TurnResult | None:
            return await handle.result(None)

        return cls(
            handle.turn_id,
            handle.request.session_id,
            assistant_id,
            handle.events(),
            result,
            handle.close,
            answered_directly=True,
        )


async def resumed(
    client: LoopwireClient,
    redis: Redis,
    thread_id: str,
    resume: Any,
    by: str,
    before: Callable[[str], Awaitable[None]] | None = None,
) -> Following:
    """The thread's run that waits for decisions, decided as ``resume`` says, followed."""
    summary = await client.sessions.get(thread_id)
    run_id = summary.running if summary is not None and summary.parked else None
    calls = await approvals.waiting(redis, run_id) if run_id is not None else []
    if summary is None or run_id is None or not calls:
        raise RunError(409, f"thread {thread_id} has no run waiting for a decision")
    chosen = approvals.decisions(resume, calls)
    if before is not None:  # e.g. its webhook registered
        await before(run_id)
    stack = contextlib.AsyncExitStack()
    events = await stack.enter_async_context(subscribed(client, run_id))
    try:
        await approvals.decide(client, thread_id, run_id, chosen, by)
    except BaseException:
        await stack.aclose()
        raise

    async def result() -> TurnResult | None:
        return await client.sessions.result(run_id, thread_id)

    return Following(run_id, thread_id, summary.agent, events, result, stack.aclose)
