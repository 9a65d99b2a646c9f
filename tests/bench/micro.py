"""Micro-benchmarks run in the driver process: the model adapter's client paths and the tool
RPC round trip. CPU is this process's (``time.process_time``, all threads) per call; the
servers run in their own processes (their CPU is read from ``/proc``)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import aiohttp
import httpx2
import openai
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion

from contracts.messages import ChatMessage
from contracts.tools import ToolCallRequest, ToolContext, ToolDefinition, idempotency_key
from tests.bench.floor import RawRpc
from tests.bench.procs import Proc
from tests.bench.targets import ModelServer, chat_history
from tests.bench.workload import AMQP_URL, SYSTEM_PROMPT, TOOL, tool_definition, turn_input
from worker.loop.ports import ModelRequest
from worker.model.adapter import OpenAIModel, build_body, encode_body
from worker.model.http import ModelClient, ModelHttpClient
from worker.transport.rpc import ToolRPC

Call = Callable[[], Awaitable[Any]]


def bench_request() -> ModelRequest:
    function = tool_definition()["function"]
    definition = ToolDefinition(
        name=TOOL, description=function["description"], parameters=function["parameters"]
    )
    messages = [
        ChatMessage.system(SYSTEM_PROMPT),
        *chat_history(),
        ChatMessage.user(turn_input("micro")),
    ]
    return ModelRequest(messages=messages, tools=[definition])


def _client(base_url: str, transport: str, concurrency: int) -> AsyncOpenAI:
    timeout = httpx2.Timeout(120, connect=10)
    limits = httpx2.Limits(
        max_connections=max(100, concurrency), max_keepalive_connections=max(100, concurrency)
    )
    http_client: httpx2.AsyncClient
    if transport == "lean":
        http_client = ModelHttpClient(timeout=timeout, limits=limits)
    elif transport == "aiohttp":
        http_client = openai.DefaultAioHttpClient(timeout=timeout, limits=limits)
    else:
        http_client = httpx2.AsyncClient(timeout=timeout, limits=limits)
    client = ModelClient if transport == "lean" else AsyncOpenAI  # the lean pair: the worker's
    return client(
        base_url=base_url, api_key="bench", max_retries=2, timeout=timeout, http_client=http_client
    )


async def measure(call: Call, n: int, concurrency: int) -> dict[str, float]:
    """CPU ms (this process) and wall ms per call, with ``concurrency`` calls at a time."""
    for _ in range(min(20, n)):
        await call()
    slots = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one() -> None:
        async with slots:
            started = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - started)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    latencies.sort()
    return {
        "cpu_ms": 1000 * cpu / n,
        "wall_ms": 1000 * wall / n,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


ADAPTER_VARIANTS = (
    "create",
    "post_dict_typed",
    "post_bytes_typed",
    "post_bytes_raw_httpx",
    "post_bytes_raw_aiohttp",
    "adapter_httpx",
    "adapter_aiohttp",
    "adapter_lean",
    "plain_aiohttp",
)
"""What one model call costs on each client path, old to new:

- ``create``: ``client.chat.completions.create(**body)``;
- ``post_dict_typed``: ``client.post(body=dict, cast_to=ChatCompletion)`` (the adapter before);
- ``post_bytes_typed``: pre-encoded JSON as ``content``, still parsed into ``ChatCompletion``;
- ``post_bytes_raw_httpx`` / ``_aiohttp``: pre-encoded bytes, ``cast_to=httpx2.Response`` and
  ``json.loads``, on httpx's transport / the client's aiohttp transport;
- ``adapter_httpx`` / ``adapter_aiohttp``: ``worker.model.adapter.OpenAIModel.complete`` end to end
  (building the body from ``ChatMessage`` objects and parsing into ``ModelResponse``);
- ``adapter_lean``: the same on ``worker.model.http.ModelClient`` over ``ModelHttpClient``
  (what the worker uses);
- ``plain_aiohttp``: a bare aiohttp POST + ``json.loads`` (the floor's model call).
"""


async def adapter_round(
    model: ModelServer, *, n: int, concurrency: int, variants: tuple[str, ...] = ADAPTER_VARIANTS
) -> dict[str, dict[str, float]]:
    request = bench_request()
    httpx_client = _client(model.base_url, "httpx", concurrency)
    aio_client = _client(model.base_url, "aiohttp", concurrency)
    lean_client = _client(model.base_url, "lean", concurrency)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    url = model.base_url + "/chat/completions"
    body = build_body(request, "bench")
    json_headers = {"Content-Type": "application/json", "Authorization": "Bearer bench"}

    async def create() -> None:
        await httpx_client.chat.completions.create(**body)

    async def post_dict_typed() -> None:
        await httpx_client.post(
            "/chat/completions", body=build_body(request, "bench"), cast_to=ChatCompletion
        )

    async def post_bytes_typed() -> None:
        await httpx_client.post(
            "/chat/completions", content=encode_body(request, "bench"), cast_to=ChatCompletion
        )

    def raw(client: AsyncOpenAI) -> Call:
        async def call() -> None:
            response = await client.post(
                "/chat/completions", content=encode_body(request, "bench"), cast_to=httpx2.Response
            )
            json.loads(response.content)

        return call

    async def plain_aiohttp() -> None:
        data = json.dumps(build_body(request, "bench")).encode()
        async with session.post(url, data=data, headers=json_headers) as response:
            json.loads(await response.read())

    calls: dict[str, Call] = {
        "create": create,
        "post_dict_typed": post_dict_typed,
        "post_bytes_typed": post_bytes_typed,
        "post_bytes_raw_httpx": raw(httpx_client),
        "post_bytes_raw_aiohttp": raw(aio_client),
        "adapter_httpx": lambda: OpenAIModel(httpx_client, model="bench").complete(request),
        "adapter_aiohttp": lambda: OpenAIModel(aio_client, model="bench").complete(request),
        "adapter_lean": lambda: OpenAIModel(lean_client, model="bench").complete(request),
        "plain_aiohttp": plain_aiohttp,
    }
    results: dict[str, dict[str, float]] = {}
    try:
        for name in variants:
            count = max(20, n // 8) if name == "create" else n
            results[name] = await measure(calls[name], count, concurrency)
    finally:
        await httpx_client.close()
        await aio_client.close()
        await lean_client.close()
        await session.close()
    return results


async def rpc_round(
    *, calculator: Proc, raw_tool: Proc, run_id: str, n: int, concurrency: int
) -> dict[str, dict[str, float]]:
    """loopwire's ``ToolRPC`` against the SDK's calculator service, and a raw aio-pika RPC
    against the raw responder: caller CPU, service CPU and latency per call."""
    connection = await aio_pika.connect(AMQP_URL)
    results: dict[str, dict[str, float]] = {}
    try:
        rpc = ToolRPC(await connection.channel(publisher_confirms=True, on_return_raises=True))
        await rpc.start()
        raw = RawRpc(await connection.channel(publisher_confirms=False))
        await raw.start()
        function = tool_definition()["function"]
        definition = ToolDefinition(
            name=TOOL, description=function["description"], parameters=function["parameters"]
        )
        turn = f"b{run_id}-rpc{uuid.uuid4().hex[:6]}"
        counter = iter(range(10**9))

        async def loopwire_call() -> None:
            call_id = f"call_{next(counter)}"
            request = ToolCallRequest(
                call_id=call_id,
                tool=TOOL,
                arguments={"expression": "6*7"},
                context=ToolContext(
                    session_id=turn,
                    turn_id=turn,
                    agent="bench",
                    deadline=time.time() + 30,
                    idempotency_key=idempotency_key(turn, call_id),
                ),
            )
            reply = await rpc.call(request, definition)
            if reply.status != "ok":
                raise RuntimeError(f"tool call failed: {reply.error}")

        body = json.dumps({"expression": "6*7"}).encode()

        async def raw_call() -> None:
            await raw.call(body)

        for name, call, service in (
            ("raw", raw_call, raw_tool),
            ("loopwire", loopwire_call, calculator),
        ):
            cpu0 = service.cpu()
            result = await measure(call, n, concurrency)
            result["service_cpu_ms"] = 1000 * (service.cpu() - cpu0) / (n + min(20, n))
            results[name] = result
    finally:
        await connection.close()
    return results
