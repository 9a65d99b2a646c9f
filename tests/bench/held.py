"""What a model call in flight holds, by client stack: the memory floor under a turn in flight.

``python -m tests.bench.held BASE_URL CONTROL_URL CALLS VARIANT`` warms the client up, then
makes the bench model server hold its answers and starts ``CALLS`` calls at once; when the
server reports them all waiting it prints, as JSON, the growth of this process's RSS divided by
the calls. All calls send the same body bytes, so only what each call's client stack keeps is
counted. One variant per process: memory one variant freed would otherwise be reused by the
next and hide its cost.

- ``plain_aiohttp``: a bare aiohttp POST (the floor's model call);
- ``openai_lean``: ``ModelClient.post`` of pre-encoded bytes on ``ModelHttpClient``, the
  worker's client stack.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import httpx2
import uvloop

from tests.bench.micro import bench_request
from tests.bench.procs import rss_bytes
from worker.model.adapter import encode_body
from worker.model.http import ModelClient, ModelHttpClient

VARIANTS = ("plain_aiohttp", "openai_lean")
HOLD_S = 120.0


async def _control(session: aiohttp.ClientSession, control: str, delay: float) -> None:
    async with session.post(f"{control}/config", json={"delay": delay}) as response:
        response.raise_for_status()


async def _waiting(session: aiohttp.ClientSession, control: str) -> int:
    async with session.get(f"{control}/stats") as response:
        data: dict[str, Any] = await response.json()
        return int(data["waiting"])


async def measure(base_url: str, control: str, calls: int, variant: str) -> dict[str, Any]:
    body = encode_body(bench_request(), "bench")
    url = base_url + "/chat/completions"
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    api = ModelClient(
        base_url=base_url,
        api_key="bench",
        max_retries=2,
        http_client=ModelHttpClient(
            timeout=httpx2.Timeout(HOLD_S + 60, connect=10),
            limits=httpx2.Limits(max_connections=calls + 64, max_keepalive_connections=calls + 64),
        ),
    )

    async def plain_aiohttp() -> None:
        headers = {"Content-Type": "application/json", "Authorization": "Bearer bench"}
        async with session.post(url, data=body, headers=headers) as response:
            await response.read()

    async def openai_lean() -> None:
        await api.post("/chat/completions", content=body, cast_to=httpx2.Response)

    call: Callable[[], Awaitable[None]] = {
        "plain_aiohttp": plain_aiohttp,
        "openai_lean": openai_lean,
    }[variant]
    control_session = aiohttp.ClientSession()
    tasks: list[asyncio.Task[None]] = []
    try:
        await _control(control_session, control, 0)
        await asyncio.gather(*(call() for _ in range(32)))
        gc.collect()
        before = rss_bytes(os.getpid())
        await _control(control_session, control, HOLD_S)
        tasks = [asyncio.ensure_future(call()) for _ in range(calls)]
        deadline = time.monotonic() + 60
        while await _waiting(control_session, control) < calls:
            if time.monotonic() > deadline:
                raise TimeoutError("the model server never held every call")
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)
        held = rss_bytes(os.getpid())
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _control(control_session, control, 0)
        await control_session.close()
        await session.close()
        await api.close()
    return {"variant": variant, "calls": calls, "kb_per_call": (held - before) / 1024 / calls}


def main() -> None:
    base_url, control, calls, variant = sys.argv[1:5]
    # on uvloop, as the worker runs: what a connection costs depends on the event loop
    result = uvloop.run(measure(base_url, control, int(calls), variant))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
