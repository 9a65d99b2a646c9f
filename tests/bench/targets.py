"""The systems under test and what they share: the bench model server, the floor and
loopwire (their worker processes, their tool service, how to seed a session and start a turn),
and the driver's own connections."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import aio_pika
import aiohttp
from aio_pika.abc import AbstractChannel, AbstractRobustConnection
from aio_pika.exceptions import ChannelClosed

from contracts import keys
from contracts import topology as t
from contracts.codec import decode, encode
from contracts.messages import ChatMessage, ToolCall
from contracts.registry import live_tools
from contracts.runtime.redis_client import ready, redis_client
from contracts.state import AgentState, SessionContext
from contracts.turns import InputMessage, TurnRequest, TurnResult
from tests.bench import floor, floor_protocol
from tests.bench.lookup import LOOKUP
from tests.bench.procs import ROOT, Proc, free_port, http_ok
from tests.bench.workload import (
    AGENT,
    AMQP_URL,
    KEY_TTL_S,
    REDIS_CLUSTER,
    REDIS_URL,
    SYSTEM_PROMPT,
    TOOL,
    history,
    turn_input,
)
from worker.transport.topology import declare


class ModelServer:
    """The bench model server process and its control port."""

    def __init__(self) -> None:
        self.proc = Proc("model", ["-m", "tests.bench.model_server"])
        self.base_url = ""
        self.control = ""

    async def start(self) -> None:
        """Start it on ports the system picks (no race for a port with other processes)."""
        self.proc.start()
        await self.proc.wait_ready(_log_says_ready(self.proc))
        line = next(ln for ln in self.proc.log().splitlines() if ln.startswith("ready "))
        port, control = line.split()[1:3]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.control = f"http://127.0.0.1:{control}"

    async def configure(
        self,
        delay: float,
        content_chars: int | None = None,
        tool: tuple[str, dict[str, Any]] | None = None,
    ) -> None:
        """The answer delay; ``content_chars``: the text each tool-calling answer carries;
        ``tool``: the tool every answer calls and its arguments (the calculator's by default)."""
        config: dict[str, Any] = {"delay": delay}
        if content_chars is not None:
            config["content_chars"] = content_chars
        if tool is not None:
            config["tool"], config["arguments"] = tool
        await self._post("/config", config)

    async def barrier(self, steps: list[int], turns: int) -> None:
        """Hold every turn's request for these model calls until ``release`` (``[]``: none)."""
        await self._post("/barrier", {"steps": steps, "turns": turns})

    async def barrier_full(self, step: int, timeout_s: float) -> bool:
        """Whether every turn waits at the barrier of ``step``, within ``timeout_s``."""
        url = f"{self.control}/barrier/wait?step={step}&timeout={timeout_s}"
        timeout = aiohttp.ClientTimeout(total=timeout_s + 10)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url) as response,
        ):
            response.raise_for_status()
            return bool((await response.json())["full"])

    async def release(self, step: int) -> None:
        await self._post(f"/barrier/release?step={step}", {})

    async def _post(self, path: str, payload: dict[str, Any]) -> None:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.control}{path}", json=payload) as response,
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

    def __init__(self, shared: Shared, model: ModelServer, *, prefetch: int, steps: int) -> None:
        self.shared = shared
        self.model = model
        self.prefetch = prefetch
        self.steps = steps
        self.workers: list[Proc] = []
        self.helpers: list[Proc] = []

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
        self.redis = redis_client(REDIS_URL, cluster=REDIS_CLUSTER, max_connections=64, timeout=30)
        self.connection: AbstractRobustConnection | None = None
        self.channel: AbstractChannel | None = None

    async def start(self) -> None:
        await ready(self.redis)
        self.connection = await aio_pika.connect_robust(AMQP_URL)
        self.channel = await self.connection.channel(publisher_confirms=True)
        await declare(self.channel)
        await self.channel.declare_queue(floor.WORK_QUEUE, durable=True, arguments=floor.QUORUM)
        await self.channel.declare_queue(floor.TOOL_QUEUE, durable=True, arguments=floor.QUORUM)
        for name in (floor_protocol.WORK_QUEUE, floor_protocol.TOOL_QUEUE):
            await self.channel.declare_queue(name, durable=True, arguments=floor.QUORUM)
        for tool in (TOOL, LOOKUP):
            await self.channel.declare_queue(
                t.tool_queue(tool), durable=True, arguments=floor.QUORUM
            )
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
            t.tool_queue(LOOKUP),
            floor.WORK_QUEUE,
            floor.TOOL_QUEUE,
            floor_protocol.WORK_QUEUE,
            floor_protocol.TOOL_QUEUE,
        ):
            queue = await self.channel.get_queue(name, ensure=False)
            await queue.purge()
        # a parked turn's timeout waits in a delay queue and would come back in a later
        # scenario (for an agent that scenario does not run): emptied too, where it exists
        assert self.connection is not None
        for seconds in t.WAIT_BUCKETS_S:
            probe = await self.connection.channel()
            try:
                waiting = await probe.declare_queue(t.wait_queue(seconds), passive=True)
                await waiting.purge()
            except ChannelClosed:
                pass  # no worker declared it yet
            finally:
                with contextlib.suppress(Exception):
                    await probe.close()

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
    """The floor (``tests.bench.floor``), or with ``protocol`` the protocol floor
    (``tests.bench.floor_protocol``): the floor making every operation the design requires."""

    def __init__(
        self,
        shared: Shared,
        model: ModelServer,
        *,
        prefetch: int,
        steps: int,
        protocol: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(shared, model, prefetch=prefetch, steps=steps)
        self.history = history()
        self.name = "protocol" if protocol else "floor"
        self.module: ModuleType = floor_protocol if protocol else floor
        self.env = env or {}
        """The worker processes' environment, over the benchmark's."""

    async def start_helpers(self) -> None:
        tool = Proc(f"{self.name}-tool", ["-m", self.module.__name__, "tool"])
        tool.start()
        self.helpers.append(tool)
        await tool.wait_ready(_log_says_ready(tool))

    async def add_worker(self) -> None:
        proc = Proc(
            f"{self.name}-worker-{len(self.workers) + 1}",
            [
                "-m",
                self.module.__name__,
                "worker",
                "--model-url",
                self.model.base_url,
                "--prefetch",
                str(self.prefetch),
            ],
            env=self.env,
        )
        proc.start(self.profile_dir)
        self.workers.append(proc)
        await proc.wait_ready(_log_says_ready(proc))

    async def seed_and_publish(self, turn_id: str, session_id: str, reply_to: str) -> None:
        await self.module.seed_and_start(
            self.shared.redis,
            self.shared.publish,
            self.history,
            session_id=session_id,
            turn_id=turn_id,
            user_input=turn_input(turn_id),
            steps=self.steps,
            reply_to=reply_to,
        )


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
        variant: str = "",
        agent_extra: dict[str, Any] | None = None,
        extra_agents: tuple[dict[str, Any], ...] = (),
    ) -> None:
        super().__init__(shared, model, prefetch=prefetch, steps=steps)
        if variant:
            self.name = f"loopwire-{variant}"
        self.source = source
        """Run the worker from this source tree instead (e.g. a baseline checkout)."""
        self.extra_env = extra_env or {}
        self.agents_file = (
            agents_dir / f"bench-agents-{steps}{'-' + variant if variant else ''}.json"
        )
        agent = {
            "name": AGENT,
            "system_prompt": SYSTEM_PROMPT,
            "tools": [TOOL],
            "limits": {"max_tool_iterations": steps},
            **(agent_extra or {}),
        }
        self.agents_file.write_text(json.dumps({"agents": [agent, *extra_agents]}))
        self.history_blobs = [encode(m) for m in chat_history()]
        self.failures = 0
        self.agent = AGENT
        """The agent the turns are started for."""

    async def start_helpers(self) -> None:
        await self.start_tool_service("calculator", "tool_services.calculator", TOOL)

    async def start_tool_service(self, name: str, module: str, tool_name: str) -> None:
        """Start a tool service (``python -m module``) and wait until it announces its tool."""
        tool = Proc(
            name,
            ["-m", module],
            env={
                "LOOPWIRE_AMQP_URL": AMQP_URL,
                "LOOPWIRE_REDIS_URL": REDIS_URL,
                "LOOPWIRE_LOG_LEVEL": "WARNING",
                "LOOPWIRE_TOOLS__CONCURRENCY": "256",
                "LOOPWIRE_TOOLS__IDEMPOTENCY_TTL_S": str(KEY_TTL_S),
                "LOOPWIRE_TOOLS__HTTP_PORT": "0",
            },
        )
        tool.start()
        self.helpers.append(tool)

        async def announced() -> bool:
            return tool_name in await live_tools(self.shared.redis)

        await tool.wait_ready(announced)

    async def add_worker(self, attempts: int = 3) -> None:
        """Start one more worker; its health port is picked free just before, so if another
        process took it meanwhile the worker exits at once: try again with another port."""
        for attempt in range(1, attempts + 1):
            try:
                await self._start_worker(free_port())
                return
            except RuntimeError:
                if attempt == attempts:
                    raise

    async def _start_worker(self, port: int) -> None:
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
        try:
            await proc.wait_ready(lambda: http_ok(f"http://127.0.0.1:{port}/readyz"))
        except BaseException:
            proc.stop()
            raise
        self.workers.append(proc)

    async def seed_and_publish(self, turn_id: str, session_id: str, reply_to: str) -> None:
        now = time.time()
        state = AgentState(
            session_id=session_id,
            agent=self.agent,
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
            agent=self.agent,
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


def chat_history() -> list[ChatMessage]:
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
