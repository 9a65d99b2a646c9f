"""Closed-loop load against the floor or loopwire, and what one window of it cost.

``sessions`` turns are in flight at all times: each on a fresh session whose state already
holds the 40-message history; when a turn's reply arrives the driver starts the next one.
After a warm-up the driver measures a window: the model server counts the steps (one model
call per step, for both systems), ``/proc`` gives the CPU time of every worker process, and
the model server reports the time every step spent outside the model call.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import msgpack
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection
from redis.asyncio import BlockingConnectionPool, Redis

from contracts import keys
from contracts import topology as t
from contracts.codec import decode, encode
from contracts.messages import ChatMessage, ToolCall
from contracts.state import AgentState, SessionContext
from contracts.turns import InputMessage, TurnRequest, TurnResult
from tests.bench import floor
from tests.bench.procs import ROOT, Proc, free_port, http_ok
from tests.bench.workload import (
    AGENT,
    AMQP_URL,
    REDIS_URL,
    SYSTEM_PROMPT,
    TOOL,
    history,
    turn_input,
)
from tool_services.registry import live_tools
from worker.topology import declare

KEY_TTL_S = 900


class ModelServer:
    """The bench model server process and its control port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.control = f"http://127.0.0.1:{free_port()}"
        self.proc = Proc(
            "model",
            [
                "-m",
                "tests.bench.model_server",
                "--port",
                str(self.port),
                "--control-port",
                self.control.rsplit(":", 1)[1],
            ],
        )
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> None:
        self.proc.start()
        await self.proc.wait_ready(lambda: http_ok(f"{self.control}/stats"))

    async def configure(self, delay: float) -> None:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.control}/config", json={"delay": delay}) as response,
        ):
            response.raise_for_status()

    async def stats(self, reset: bool = False) -> dict[str, Any]:
        url = f"{self.control}/stats" + ("?reset=1" if reset else "")
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            data: dict[str, Any] = await response.json()
            return data

    def stop(self) -> None:
        self.proc.stop()


class Target:
    """A system under test: its worker processes, how to seed a session and start a turn."""

    profile_dir: Path | None = None
    """Run the worker processes under cProfile, writing ``<name>.prof`` here."""
    name: str
    workers: list[Proc]
    helpers: list[Proc]

    async def start(self, count: int) -> None:
        """Start the helper processes (tool service), then ``count`` workers."""
        await self.start_helpers()
        for _ in range(count):
            await self.add_worker()

    async def start_helpers(self) -> None:
        raise NotImplementedError

    async def seed_and_publish(self, turn_id: str, session_id: str, reply_to: str) -> None:
        raise NotImplementedError

    async def add_worker(self) -> None:
        raise NotImplementedError

    async def stop_workers(self) -> None:
        for proc in self.workers:
            proc.stop()
            proc.remove_log()
        self.workers = []

    def stop(self) -> None:
        for proc in [*self.workers, *self.helpers]:
            proc.stop()
            proc.remove_log()

    def health(self) -> dict[str, int]:
        return {}


class Shared:
    """Connections the driver uses for every target."""

    def __init__(self) -> None:
        # redis-py raises past max_connections with its default pool; this one waits instead
        pool = BlockingConnectionPool.from_url(REDIS_URL, max_connections=64, timeout=30)
        self.redis = Redis.from_pool(pool)
        self.connection: AbstractRobustConnection | None = None
        self.channel: AbstractChannel | None = None

    async def start(self) -> None:
        self.connection = await aio_pika.connect_robust(AMQP_URL)
        self.channel = await self.connection.channel(publisher_confirms=True)
        await declare(self.channel)
        await self.channel.declare_queue(floor.WORK_QUEUE, durable=True, arguments=floor.QUORUM)
        await self.channel.declare_queue(floor.TOOL_QUEUE, durable=True, arguments=floor.QUORUM)
        await self.channel.declare_queue(t.tool_queue(TOOL), durable=True, arguments=floor.QUORUM)
        await self.purge_work()

    async def close(self) -> None:
        if self.connection is not None:
            await self.connection.close()
        await self.redis.aclose()

    async def publish(self, body: bytes, routing_key: str, **props: Any) -> None:
        assert self.channel is not None
        await self.channel.default_exchange.publish(
            aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, **props),
            routing_key=routing_key,
        )

    async def purge_work(self) -> None:
        """Empty every work and tool queue (after aborting the turns in flight)."""
        assert self.channel is not None
        for name in (
            t.TURNS_QUEUE,
            t.RETRY_QUEUE,
            t.tool_queue(TOOL),
            floor.WORK_QUEUE,
            floor.TOOL_QUEUE,
        ):
            queue = await self.channel.get_queue(name, ensure=False)
            await queue.purge()

    async def delete_matching(self, pattern: str) -> int:
        removed = 0
        batch: list[Any] = []
        async for key in self.redis.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 500:
                removed += await self.redis.unlink(*batch)
                batch = []
        if batch:
            removed += await self.redis.unlink(*batch)
        return removed


class FloorTarget(Target):
    name = "floor"

    def __init__(self, shared: Shared, model: ModelServer, *, prefetch: int, steps: int) -> None:
        self.shared = shared
        self.model = model
        self.prefetch = prefetch
        self.steps = steps
        self.workers = []
        self.helpers = []
        self.history = history()

    async def start_helpers(self) -> None:
        tool = Proc("floor-tool", ["-m", "tests.bench.floor", "tool"])
        tool.start()
        self.helpers.append(tool)
        await tool.wait_ready(_log_says_ready(tool))

    async def add_worker(self) -> None:
        proc = Proc(
            f"floor-worker-{len(self.workers) + 1}",
            [
                "-m",
                "tests.bench.floor",
                "worker",
                "--model-url",
                self.model.base_url,
                "--prefetch",
                str(self.prefetch),
            ],
        )
        proc.start(self.profile_dir)
        self.workers.append(proc)
        await proc.wait_ready(_log_says_ready(proc))

    async def seed_and_publish(self, turn_id: str, session_id: str, reply_to: str) -> None:
        messages = [*self.history, {"role": "user", "content": turn_input(turn_id)}]
        key = floor.state_key(session_id)
        async with self.shared.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={"v": 1, "s": msgpack.packb({"messages": messages})})
            pipe.expire(key, KEY_TTL_S)
            await pipe.execute()
        work = {"s": session_id, "t": turn_id, "k": 0, "n": self.steps, "r": reply_to}
        await self.shared.publish(msgpack.packb(work), floor.WORK_QUEUE)


class LoopwireTarget(Target):
    name = "loopwire"

    def __init__(
        self,
        shared: Shared,
        model: ModelServer,
        *,
        prefetch: int,
        steps: int,
        agents_dir: Path,
        extra_env: dict[str, str] | None = None,
        source: Path | None = None,
    ) -> None:
        self.source = source
        """Run the worker from this source tree instead (e.g. a baseline checkout)."""
        self.shared = shared
        self.model = model
        self.prefetch = prefetch
        self.steps = steps
        self.extra_env = extra_env or {}
        self.workers = []
        self.helpers = []
        self.agents_file = agents_dir / f"bench-agents-{steps}.json"
        self.agents_file.write_text(
            json.dumps(
                {
                    "agents": [
                        {
                            "name": AGENT,
                            "system_prompt": SYSTEM_PROMPT,
                            "tools": [TOOL],
                            "limits": {"max_tool_iterations": steps},
                        }
                    ]
                }
            )
        )
        self.history_blobs = [encode(m) for m in _chat_history()]
        self.failures = 0

    async def start_helpers(self) -> None:
        tool = Proc(
            "calculator",
            ["-m", "tool_services.calculator"],
            env={
                "LOOPWIRE_AMQP_URL": AMQP_URL,
                "LOOPWIRE_REDIS_URL": REDIS_URL,
                "LOOPWIRE_LOG_LEVEL": "WARNING",
                "LOOPWIRE_TOOLS__CONCURRENCY": "256",
                "LOOPWIRE_TOOLS__IDEMPOTENCY_TTL_S": str(KEY_TTL_S),
            },
        )
        tool.start()
        self.helpers.append(tool)

        async def announced() -> bool:
            return TOOL in await live_tools(self.shared.redis)

        await tool.wait_ready(announced)

    async def add_worker(self) -> None:
        port = free_port()
        proc = Proc(
            f"loopwire-worker-{len(self.workers) + 1}",
            ["-m", "worker"],
            env={
                "LOOPWIRE_AMQP_URL": AMQP_URL,
                "LOOPWIRE_REDIS_URL": REDIS_URL,
                "LOOPWIRE_MODEL__BASE_URL": self.model.base_url,
                "LOOPWIRE_MODEL__MAX_CONNECTIONS": str(max(1000, 2 * self.prefetch)),
                "LOOPWIRE_AGENTS_FILE": str(self.agents_file),
                "LOOPWIRE_HTTP_PORT": str(port),
                "LOOPWIRE_PREFETCH": str(self.prefetch),
                "LOOPWIRE_STATE_TTL_S": str(KEY_TTL_S),
                "LOOPWIRE_LOG_LEVEL": "WARNING",
                **self.extra_env,
            },
            cwd=self.source or ROOT,
        )
        proc.start(self.profile_dir)
        self.workers.append(proc)
        await proc.wait_ready(lambda: http_ok(f"http://127.0.0.1:{port}/readyz"))

    async def seed_and_publish(self, turn_id: str, session_id: str, reply_to: str) -> None:
        now = time.time()
        state = AgentState(
            session_id=session_id,
            agent=AGENT,
            context=SessionContext(system_prompt=SYSTEM_PROMPT),
            history_len=len(self.history_blobs),
            created_at=now,
            updated_at=now,
        )
        async with self.shared.redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.session_state(session_id), mapping={"v": 1, "s": encode(state)})
            pipe.rpush(keys.session_history(session_id), *self.history_blobs)
            pipe.expire(keys.session_state(session_id), KEY_TTL_S)
            pipe.expire(keys.session_history(session_id), KEY_TTL_S)
            await pipe.execute()
        request = TurnRequest(
            turn_id=turn_id,
            session_id=session_id,
            agent=AGENT,
            input=(InputMessage(content=turn_input(turn_id)),),
            reply_to=reply_to,
        )
        await self.shared.publish(
            encode(request),
            t.TURNS_QUEUE,
            content_type=t.CONTENT_TYPE,
            message_id=turn_id,
            headers={t.H_KIND: t.KIND_START},
        )

    def check(self, body: bytes) -> None:
        result = decode(body, TurnResult)
        if result.finish_reason != "max_iterations" or result.steps != self.steps:
            self.failures += 1

    def health(self) -> dict[str, int]:
        return {
            "transient_retries": sum(
                w.count_in_log("retrying work after a transient failure") for w in self.workers
            ),
            "step_failures": sum(w.count_in_log("step failed") for w in self.workers),
            "bad_results": self.failures,
        }


def _chat_history() -> list[ChatMessage]:
    out = []
    for m in history():
        calls = tuple(
            ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
            for c in m.get("tool_calls", ())
        )
        out.append(
            ChatMessage(
                role=m["role"],
                content=m.get("content"),
                tool_calls=calls,
                tool_call_id=m.get("tool_call_id"),
            )
        )
    return out


def _log_says_ready(proc: Proc) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return "ready" in proc.log()

    return check


@dataclass
class Window:
    """What one measured window of load cost."""

    target: str
    sessions: int
    workers: int
    seconds: float
    steps: int
    worker_cpu_s: float
    other_cpu_s: dict[str, float]
    gaps: dict[str, float]
    rss_idle: int = 0
    rss_peak: int = 0
    health: dict[str, int] = field(default_factory=dict)

    @property
    def cpu_ms_per_step(self) -> float:
        return 1000 * self.worker_cpu_s / self.steps if self.steps else float("nan")

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "sessions": self.sessions,
            "workers": self.workers,
            "seconds": round(self.seconds, 3),
            "steps": self.steps,
            "steps_per_s": round(self.steps_per_s, 1),
            "worker_cpu_s": round(self.worker_cpu_s, 3),
            "worker_cpu_ms_per_step": round(self.cpu_ms_per_step, 4),
            "other_cpu_ms_per_step": {
                k: round(1000 * v / self.steps, 4) if self.steps else None
                for k, v in self.other_cpu_s.items()
            },
            "outside_model_s": self.gaps,
            "rss_idle_mb": round(self.rss_idle / 2**20, 1),
            "rss_peak_mb": round(self.rss_peak / 2**20, 1),
            "health": self.health,
        }


class Driver:
    """Keeps ``sessions`` turns in flight against one target and measures one window."""

    def __init__(self, shared: Shared, model: ModelServer, run_id: str) -> None:
        self.shared = shared
        self.model = model
        self.run_id = run_id
        self.reply_to = ""
        self.done = 0
        self.started = 0
        self.feeding = False
        self.target: Target | None = None
        self.idle = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.errors: list[str] = []

    async def start(self) -> None:
        assert self.shared.connection is not None
        channel = await self.shared.connection.channel()
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        self.reply_to = queue.name
        await queue.consume(self._on_reply, no_ack=True)

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        self.done += 1
        if isinstance(self.target, LoopwireTarget):
            self.target.check(message.body)
        if self.feeding:
            self._launch()
        elif self.started == self.done:
            self.idle.set()

    def _launch(self) -> None:
        assert self.target is not None
        self.started += 1
        n = self.started
        turn_id = f"b{self.run_id}-{self.target.name[0]}{n}-{uuid.uuid4().hex[:6]}"
        session_id = f"b{self.run_id}-{self.target.name[0]}s{n}-{uuid.uuid4().hex[:6]}"
        task = asyncio.create_task(self.target.seed_and_publish(turn_id, session_id, self.reply_to))
        self.tasks.add(task)
        task.add_done_callback(self._launched)

    def _launched(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(repr(task.exception()))

    async def measure(
        self,
        target: Target,
        *,
        sessions: int,
        warmup_s: float,
        window_s: float,
        drain: bool = True,
        drain_s: float = 60.0,
        rss_baseline: int | None = None,
    ) -> Window:
        """Keep ``sessions`` turns in flight; measure a window after ``warmup_s``. Then wait for
        the turns in flight to finish (``drain``), or leave them: the caller aborts them."""
        self.target = target
        self.done = self.started = 0
        self.idle.clear()
        self.feeding = True
        rss0 = sum(w.rss() for w in target.workers) if rss_baseline is None else rss_baseline
        for _ in range(sessions):
            self._launch()
        await asyncio.sleep(warmup_s)
        before = await self.model.stats(reset=True)
        others = [*target.helpers, self.model.proc]
        cpu0 = {p.name: p.cpu() for p in [*target.workers, *others]}
        t0 = time.monotonic()
        peak = 0
        while time.monotonic() - t0 < window_s:
            await asyncio.sleep(min(0.5, window_s))
            peak = max(peak, sum(w.rss() for w in target.workers))
        elapsed = time.monotonic() - t0
        after = await self.model.stats()
        cpu1 = {p.name: p.cpu() for p in [*target.workers, *others]}
        self.feeding = False
        window = Window(
            target=target.name,
            sessions=sessions,
            workers=len(target.workers),
            seconds=elapsed,
            steps=after["served"] - before["served"],
            worker_cpu_s=sum(cpu1[w.name] - cpu0[w.name] for w in target.workers),
            other_cpu_s={p.name: cpu1[p.name] - cpu0[p.name] for p in others},
            gaps=after["gaps"],
            rss_idle=rss0,
            rss_peak=peak,
            health=target.health(),
        )
        if drain:
            if self.started == self.done:
                self.idle.set()
            try:
                await asyncio.wait_for(self.idle.wait(), drain_s)
            except TimeoutError:
                self.errors.append(
                    f"{target.name}: {self.started - self.done} turns did not finish "
                    f"within {drain_s:g}s; worker log:\n"
                    + "\n".join(w.log(1500) for w in target.workers)
                )
        for task in list(self.tasks):
            await task
        if self.errors:
            errors, self.errors = self.errors, []
            raise RuntimeError("; ".join(errors[:3]))
        return window

    async def hold(
        self, target: Target, *, sessions: int, baseline: int, timeout_s: float
    ) -> dict[str, float]:
        """Start ``sessions`` turns against a model that answers only after a long delay, wait
        until (nearly) all of them wait for it, and read the workers' RSS: memory per turn in
        flight. The caller aborts the turns afterwards."""
        self.target = target
        self.done = self.started = 0
        self.feeding = False
        for _ in range(sessions):
            self._launch()
        deadline = time.monotonic() + timeout_s
        waiting = 0
        while time.monotonic() < deadline:
            await asyncio.sleep(1)
            waiting = (await self.model.stats())["waiting"]
            if waiting >= 0.97 * sessions:
                break
        await asyncio.sleep(1)
        rss = max(sum(w.rss() for w in target.workers) for _ in range(3))
        waiting = (await self.model.stats())["waiting"]
        for task in list(self.tasks):
            await task
        return {
            "turns_waiting": waiting,
            "rss_baseline_mb": baseline / 2**20,
            "rss_mb": rss / 2**20,
            "kb_per_turn": (rss - baseline) / max(1, waiting) / 1024,
        }

    async def cleanup(self) -> None:
        await self.shared.delete_matching(f"lw:{{b{self.run_id}-*")
        await self.shared.delete_matching(f"lw:toolcall:{{b{self.run_id}-*")
        await self.shared.delete_matching(f"bench:floor:{{b{self.run_id}-*")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
