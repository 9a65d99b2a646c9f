"""``loopwire demo``: one real turn through RabbitMQ, Redis, three tool services and the model.

It starts a worker and the example tool services (search, calculator, notes)
as child processes, waits until they are ready, sends one turn whose answer
needs tools, prints every event as it happens and the final answer, and stops
everything it started (also on Ctrl-C or an error). The processes' logs go to a temporary
folder that is removed when the turn answered, and kept (the demo says where) when it did not.

The model is the endpoint configured with ``LOOPWIRE_MODEL__BASE_URL`` (plus
``LOOPWIRE_MODEL__API_KEY`` and ``LOOPWIRE_MODEL__MODEL``): a hosted model,
vLLM, Ollama… With none configured it runs the local scripted demo model
(``worker.cli.demo_model``) and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import IO, Any

import aiohttp

from contracts.client import FINAL_EVENTS, LoopwireClient, new_id
from contracts.registry import live_tools
from contracts.runtime.amqp import address, resolve_urls
from contracts.runtime.redis_client import redis_client
from contracts.turns import TurnResult
from gateway.http.keys import new_key
from worker.cli.demo_model import demo_model
from worker.cli.output import event_line
from worker.cli.turns import ended
from worker.settings import Settings, load_settings

DEFAULT_QUESTION = "How does loopwire keep a tool from running twice, and what is 17 * 23?"
DEMO_AGENT = {
    "name": "demo",
    "system_prompt": (
        "You are loopwire's demo assistant. Use the search tool to answer from the documentation, "
        "the calculate tool for arithmetic, and file a short note of each answer with file_note."
    ),
    "tools": ["search", "calculate", "file_note"],
}
SERVICES = ("search", "calculator", "notes")
WORKFLOW_QUESTION = "How does loopwire keep a tool from running twice?"
TRIAGE_EXAMPLE = json.loads(Path(__file__).with_name("triage.json").read_text(encoding="utf-8"))
"""The ``triage`` workflow and its agents, as ``deploy/agents.json`` declares them: a classifier
with structured output routes a request to ``billing`` or to ``support``, which asks the
``researcher`` agent as a tool."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class Children:
    """The processes the demo started; all stopped on exit."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []

    def start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, *args], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        self.procs.append((name, proc, log))

    def check(self) -> None:
        for name, proc, _ in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.tail(name)}")

    def tail(self, name: str) -> str:
        text = (self.logs / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-15:])

    def stop(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc, log in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            log.close()


async def _wait_ready(
    children: Children, settings: Settings, worker_port: int, timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    redis = redis_client(settings.redis_url, cluster=settings.redis_cluster, tls=settings.redis_tls)
    try:
        async with aiohttp.ClientSession() as http:
            while True:
                children.check()
                tools = set(await live_tools(redis))
                ready = False
                try:
                    async with http.get(f"http://127.0.0.1:{worker_port}/readyz") as response:
                        ready = response.status == 200
                except aiohttp.ClientError:
                    pass
                if ready and {"search", "calculate", "file_note"} <= tools:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        "the worker or the tool services did not become ready in time"
                    )
                await asyncio.sleep(0.2)
    finally:
        await redis.aclose()


async def _run_tree(client: LoopwireClient, question: str, timeout: float) -> TurnResult:
    """A turn of the triage workflow, printing every event of its tree as it comes."""
    turn_id = new_id()
    bound = asyncio.Event()

    async def follow() -> None:
        events = client.tree(turn_id)
        first = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.3)  # the subscription's queue is bound by now
        bound.set()
        event = await first
        while True:
            say("  " + event_line(event))
            if event.turn_id == turn_id and event.type in FINAL_EVENTS:
                return
            event = await anext(events)

    follower = asyncio.create_task(follow())
    await asyncio.wait_for(bound.wait(), 10)
    handle = await client.start_turn("triage", question, turn_id=turn_id)
    try:
        result = await handle.result(timeout)
        await asyncio.wait_for(follower, 10)
        return result
    finally:
        follower.cancel()
        await handle.close()


async def _run_http(
    children: Children,
    env: dict[str, str],
    logs: Path,
    question: str,
    timeout: float,
    client: LoopwireClient,
) -> TurnResult | None:
    """The same turn through the HTTP gateway: ``curl`` streams it, then the ``langgraph-sdk``
    client (when installed) asks for the thread's state; the run's result as the fleet stored
    it."""
    key, entry = new_key("demo", None)
    keys_file = logs / "keys.json"
    keys_file.write_text(json.dumps({"keys": [entry.model_dump(exclude_none=True)]}))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    gateway_env = {
        **env,
        "LOOPWIRE_GATEWAY__PORT": str(port),
        "LOOPWIRE_GATEWAY__KEYS_FILE": str(keys_file),
    }
    children.start("gateway", ["-m", "worker.cli", "gateway", "serve"], gateway_env)
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as http:
        while True:
            children.check()
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/readyz") as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not become ready in time")
            await asyncio.sleep(0.2)
    thread = f"demo-{uuid.uuid4().hex[:8]}"
    body = json.dumps(
        {
            "assistant_id": "demo",
            "input": {"messages": [{"role": "user", "content": question}]},
            "stream_mode": ["updates"],
            "if_not_exists": "create",
        }
    )
    say(f"  the HTTP gateway on {url}; a run streamed with curl:\n")
    say("  curl -N -H 'x-api-key: $KEY' -H 'content-type: application/json' \\")
    say(f"       -d '<the run>' {url}/threads/{thread}/runs/stream\n")
    curl = shutil.which("curl")
    if curl is None:
        raise RuntimeError("curl is not installed: the --http demo shows a run through it")
    proc = await asyncio.create_subprocess_exec(
        curl, "-sS", "-N", "--max-time", str(int(timeout)), "-H", f"x-api-key: {key}",
        "-H", "content-type: application/json", "-d", body,
        f"{url}/threads/{thread}/runs/stream",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    async for line in proc.stdout:
        text = line.decode(errors="replace").rstrip()
        if text.startswith(("event:", "id:")) or (text.startswith("data:") and len(text) < 200):
            say("  " + text)
        elif text.startswith("data:"):
            say("  " + text[:196] + "...")
    await proc.wait()
    try:
        from langgraph_sdk import get_client
    except ImportError:
        say("\n  (langgraph-sdk is not installed: pip install langgraph-sdk to see it here)")
    else:
        say("\n  the thread's state through the langgraph-sdk client:")
        say(f"  get_client(url={url!r}, api_key=KEY).threads.get_state({thread!r})")
        async with get_client(url=url, api_key=key) as sdk:
            state = await sdk.threads.get_state(thread)
        values: dict[str, Any] = dict(state["values"])  # type: ignore[arg-type]
        for message in values["messages"]:
            say(f"    {message['type']:>6}: {str(message['content'])[:100]}")
    runs = await client.sessions.turns(thread)
    return await client.sessions.result(runs[-1].turn_id, thread) if runs else None


async def run_demo(
    question: str = DEFAULT_QUESTION,
    *,
    timeout: float = 120.0,
    workflow: bool = False,
    over_http: bool = False,
) -> int:
    """One turn of the ``demo`` agent; ``workflow``: one turn of the ``triage`` workflow (every
    event of its tree is printed: the classifier's, the routed agent's, the researcher's)."""
    settings = load_settings()
    configured = "LOOPWIRE_MODEL__BASE_URL" in os.environ
    scripted = None if configured else demo_model()
    logs = Path(tempfile.mkdtemp(prefix="loopwire-demo-"))
    answered = False
    children = Children(logs)
    say("loopwire demo: one turn through RabbitMQ, Redis, three tool services and a model")
    brokers = resolve_urls(settings.amqp_url, settings.amqp_urls)
    say(
        f"  RabbitMQ {', '.join(address(u) for u in brokers)}   "
        f"Redis {settings.redis_url.split('@')[-1]}"
    )
    try:
        env = dict(os.environ)
        if scripted is not None:
            base_url = await scripted.start()
            env["LOOPWIRE_MODEL__BASE_URL"] = base_url
            env["LOOPWIRE_MODEL__MODEL"] = "loopwire-demo"
            say(
                "  model: none configured (set LOOPWIRE_MODEL__BASE_URL, LOOPWIRE_MODEL__API_KEY and"
            )
            say(
                "         LOOPWIRE_MODEL__MODEL to use a real one) -> using the local scripted demo model;"
            )
            say("         it follows a fixed plan and is not an LLM; everything else is real")
        else:
            say(f"  model: {settings.model.model} at {settings.model.base_url}")
        agents = logs / "agents.json"
        agents.write_text(json.dumps(TRIAGE_EXAMPLE if workflow else {"agents": [DEMO_AGENT]}))
        worker_port = _free_port()
        env.update({"LOOPWIRE_AGENTS_FILE": str(agents), "LOOPWIRE_HTTP_PORT": str(worker_port)})
        for service in SERVICES:
            children.start(service, ["-m", f"tool_services.{service}"], env)
        children.start("worker", ["-m", "worker"], env)
        say(f"  started a worker and the tool services {', '.join(SERVICES)}")
        await _wait_ready(children, settings, worker_port)
        say(f"\n> {question}\n")
        async with LoopwireClient(brokers, tls=settings.amqp_tls) as client:
            if over_http:
                found = await _run_http(children, env, logs, question, timeout, client)
                if found is None:
                    raise RuntimeError("the run through the gateway left no result")
                result = found
            elif workflow:
                result = await _run_tree(client, question, timeout)
            else:
                handle = await client.start_turn("demo", question)
                async for event in handle.events():
                    say("  " + event_line(event))
                result = await handle.result(timeout)
                await handle.close()
        say("")
        if result.finish_reason != "stop":
            say(f"the turn ended {ended(result)}")
            return 3
        say(f"answer: {result.content}")
        say(
            f"\n{result.steps} step(s), {result.usage.total_tokens} tokens, {result.duration_s:.2f} s; "
            f"session {result.session_id}"
        )
        answered = True
        return 0
    except (RuntimeError, TimeoutError, OSError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    finally:
        children.stop()
        if scripted is not None:
            await scripted.stop()
        if answered:
            shutil.rmtree(logs, ignore_errors=True)
        else:
            sys.stderr.write(f"the worker's and tool services' logs are in {logs}\n")
