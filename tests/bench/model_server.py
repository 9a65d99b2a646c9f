"""The bench's model: ``worker.testing.scripted_model.ScriptedModel`` answering every request with one
tool call, after a configurable delay, plus a control port.

Run: ``python -m tests.bench.model_server [--port P] [--control-port C]`` (default: ports the
system picks); it prints ``ready <port> <control port>`` once both listen.

Control (HTTP on the control port):

- ``POST /config`` ``{"delay": 2.0}``: the model's answer delay for requests from now on;
  ``{"content_chars": 1200}``: the text each tool-calling answer carries (0: none);
  ``{"tool": "lookup", "arguments": {...}}``: the tool every answer calls, with these arguments
  (``{"tool": "calculate"}``: the calculator again, with its arguments);
A request that offers the sub-agent ``SUB_AGENT`` is answered with a call to it, one that
offers no tool (the sub-agent's own) with a text answer.

- ``GET /stats`` (``?reset=1`` clears the gaps): requests served (and of those, answered with
  text: ``finals``), requests waiting for their
  answer now, and the *gap* of every step: the time
  from the model's answer for one step of a turn to the arrival of the same turn's next
  request, i.e. everything a worker does outside the model call (tool RPC, saves, events,
  publishing the next step, the queue, consuming it, loading the state, compiling the request).

- Barriers (the ``long`` scenario): ``POST /barrier`` ``{"steps": [1, 6], "turns": 32}`` holds
  every turn's request for each of those model calls (1: a turn's first; see
  ``workload.step_of``) until it is released; ``GET /barrier/wait?step=6&timeout=30`` answers
  as soon as ``turns`` distinct turns are held there (``{"held": n, "full": true}``), or after
  the timeout with ``"full": false``; ``POST /barrier/release?step=6`` lets them have their
  answers. ``{"steps": []}`` releases every barrier and sets none. While every turn waits at a
  barrier, the workers have nothing to do: whoever measures them samples their CPU then, and
  the waiting is not in any window it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import signal
import time
from typing import Any

from aiohttp import web

from tests.bench.workload import SUB_AGENT, TOOL, TOOL_ARGUMENTS, step_of, turn_of
from worker.testing.scripted_model import Reply, ScriptedModel

PROSE = "Let me work that out step by step before I answer you. "


class Gate:
    """One barrier: the turns held at one model call, and whether it is open."""

    def __init__(self) -> None:
        self.turns: set[str] = set()
        self.full = asyncio.Event()
        self.open = asyncio.Event()


class BenchModel:
    def __init__(self) -> None:
        self.server = ScriptedModel()
        self.delay = 0.0
        self.served = 0
        self.epoch = 0
        """Bumped by every ``/config``: requests still sleeping from before are not counted."""
        self.waiting: collections.Counter[int] = collections.Counter()
        self.gaps: list[float] = []
        self.answered: dict[str, float] = {}
        self.tool: tuple[str, dict[str, Any]] = (TOOL, TOOL_ARGUMENTS)
        self.content: str | None = None
        self.reply = Reply.tool_calls(self.tool)
        self.gates: dict[int, Gate] = {}
        self.gate_turns = 0
        self.delegate = Reply.tool_calls((SUB_AGENT, {"input": TOOL_ARGUMENTS["expression"]}))
        self.answer = Reply.text("42")
        self.finals = 0
        """Requests answered with text: a sub-agent's (offered no tool), not a step of a turn
        the bench drives."""

    async def respond(self, body: dict[str, Any]) -> Reply:
        arrived = time.monotonic()
        self.server.requests.clear()  # the scripted model keeps every request; we need none
        turn = turn_of(body)
        if turn is not None:
            previous = self.answered.pop(turn, None)
            if previous is not None:
                self.gaps.append(arrived - previous)
            if self.gates:
                await self._pass(turn, step_of(body))
        if self.delay > 0:
            epoch = self.epoch
            self.waiting[epoch] += 1
            try:
                await asyncio.sleep(self.delay)
            finally:
                self.waiting[epoch] -= 1
        self.served += 1
        if turn is not None:
            self.answered[turn] = time.monotonic()
        offered = body.get("tools") or ()
        if not offered:
            self.finals += 1
            return self.answer
        if any(t.get("function", {}).get("name") == SUB_AGENT for t in offered):
            return self.delegate
        return self.reply

    async def _pass(self, turn: str, step: int | None) -> None:
        """Wait at the barrier of this model call, if there is one and it is closed."""
        gate = self.gates.get(step) if step is not None else None
        if gate is None or gate.open.is_set():
            return
        gate.turns.add(turn)
        if len(gate.turns) >= self.gate_turns:
            gate.full.set()
        await gate.open.wait()

    async def config(self, request: web.Request) -> web.Response:
        data = await request.json()
        self.delay = float(data.get("delay", self.delay))
        if "content_chars" in data:  # the text each tool-calling answer carries (streamed or not)
            chars = int(data["content_chars"])
            self.content = (PROSE * (chars // len(PROSE) + 1))[:chars] or None
        if "tool" in data:
            name = str(data["tool"])
            self.tool = (name, TOOL_ARGUMENTS if name == TOOL else dict(data["arguments"]))
        self.reply = Reply.tool_calls(self.tool, content=self.content)
        self.epoch += 1
        return web.json_response({"delay": self.delay})

    async def stats(self, request: web.Request) -> web.Response:
        gaps = sorted(self.gaps)
        waiting = self.waiting[self.epoch]
        payload = {
            "served": self.served,
            "finals": self.finals,
            "waiting": waiting,
            "gaps": _summary(gaps),
        }
        if request.query.get("reset"):
            # the answer times are kept: a step whose answer came before the reset is timed when
            # its turn's next request arrives (unless the turn ended: its entry just stays)
            self.gaps = []
        return web.json_response(payload)

    async def barrier(self, request: web.Request) -> web.Response:
        data = await request.json()
        for gate in self.gates.values():
            gate.open.set()
        self.gates = {int(step): Gate() for step in data.get("steps", ())}
        self.gate_turns = int(data.get("turns", 0))
        return web.json_response({"steps": sorted(self.gates), "turns": self.gate_turns})

    async def barrier_wait(self, request: web.Request) -> web.Response:
        gate = self.gates.get(int(request.query["step"]))
        if gate is None:
            raise web.HTTPNotFound(text="no barrier at that step")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gate.full.wait(), float(request.query.get("timeout", 30)))
        return web.json_response({"held": len(gate.turns), "full": gate.full.is_set()})

    async def barrier_release(self, request: web.Request) -> web.Response:
        gate = self.gates.get(int(request.query["step"]))
        if gate is None:
            raise web.HTTPNotFound(text="no barrier at that step")
        gate.open.set()
        return web.json_response({"released": len(gate.turns)})


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}

    def pct(p: float) -> float:
        return values[min(len(values) - 1, int(p * len(values)))]

    return {"n": len(values), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": values[-1]}


async def _traces(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=b"", content_type="application/x-protobuf")


async def serve(port: int, control_port: int) -> None:
    bench = BenchModel()
    bench.server.respond_with(bench.respond)
    base_url = await bench.server.start("127.0.0.1", port)
    app = web.Application()
    app.router.add_post("/config", bench.config)
    app.router.add_get("/stats", bench.stats)
    app.router.add_post("/barrier", bench.barrier)
    app.router.add_get("/barrier/wait", bench.barrier_wait)
    app.router.add_post("/barrier/release", bench.barrier_release)
    app.router.add_post("/v1/traces", _traces)  # an OTLP/HTTP sink for the tracing scenario
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", control_port).start()
    bound = int(base_url.rsplit(":", 1)[1].split("/", 1)[0])
    print(f"ready {bound} {runner.addresses[0][1]}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    try:
        await stopping.wait()
    finally:
        await runner.cleanup()
        await bench.server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.model_server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--control-port", type=int, default=0)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.control_port))


if __name__ == "__main__":
    main()
