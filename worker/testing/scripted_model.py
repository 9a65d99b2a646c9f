"""A scripted, OpenAI-compatible chat-completions server for tests and demos.

`ScriptedModel` serves ``POST /v1/chat/completions`` on a real TCP port so that the
real ``openai`` client (in this process or in worker processes) can talk to it.
Tests queue the replies they expect, step by step, with `ScriptedModel.expect`;
a call that arrives with nothing queued, and an expectation that is never consumed,
are both reported by `ScriptedModel.assert_done`.  For many concurrent conversations
arriving in arbitrary order, `ScriptedModel.respond_with` installs a fallback that
chooses the reply from the request itself.

Run ``python -m worker.testing.scripted_model --port 8099 --echo`` for a standalone server
that answers every request with ``echo: <last user message>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import itertools
import json
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from worker.testing.replies import (
    Reply,
    Responder,
    echo_responder,
    embedding_of,
    estimate_prompt_tokens,
    summarize,
)
from worker.testing.streamed import stream_chunks

__all__ = ["Reply", "Responder", "ScriptedModel", "echo_responder"]

_SHUTDOWN_TIMEOUT = 1.0
_CLIENT_MAX_SIZE = 64 * 1024 * 1024


@dataclass(slots=True)
class _Expectation:
    reply: Reply
    check: Callable[[dict[str, Any]], object] | None


def _error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    error_type = "server_error" if status >= 500 else "invalid_request_error"
    if status == 429:
        error_type = "rate_limit_exceeded"
    payload = {"error": {"message": message, "type": error_type, "param": None, "code": None}}
    return web.Response(
        status=status,
        body=json.dumps(payload).encode(),
        content_type="application/json",
        headers=headers,
    )


class ScriptedModel:
    """An OpenAI-compatible chat-completions server answering from a script."""

    def __init__(self, *, model: str = "scripted-model") -> None:
        self.model = model
        self.embedded = 0
        """Texts embedded so far (``/v1/embeddings``)."""
        self.requests: list[dict[str, Any]] = []
        self.streamed = 0
        """Answers sent as server-sent events (requests with ``stream: true``)."""
        self.failures: list[str] = []
        self._expectations: deque[_Expectation] = deque()
        self._responder: Responder | None = None
        self._completion_ids = itertools.count(1)
        self._call_ids = itertools.count(1)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._sleeping: set[asyncio.Task[Any]] = set()
        self._runner: web.AppRunner | None = None
        self._base_url: str | None = None

    # -- lifecycle -------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start listening; returns the base URL (``http://HOST:PORT/v1``)."""
        if self._runner is not None:
            raise RuntimeError("ScriptedModel is already started")
        app = web.Application(client_max_size=_CLIENT_MAX_SIZE)
        app.router.add_post("/v1/chat/completions", self._handle_chat)
        app.router.add_get("/v1/models", self._handle_models)
        app.router.add_post("/v1/embeddings", self._handle_embeddings)
        app.router.add_get("/healthz", self._handle_health)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            bound_host, bound_port = runner.addresses[0][:2]
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._base_url = f"http://{bound_host}:{bound_port}/v1"
        return self._base_url

    async def _handle_embeddings(self, request: web.Request) -> web.Response:
        """``POST /v1/embeddings``: deterministic vectors (``embedding_of``), so that texts that
        share words are close; counted in ``embedded``."""
        body = await request.json()
        given = body.get("input")
        texts = [given] if isinstance(given, str) else list(given or [])
        self.embedded += len(texts)
        data = [
            {"object": "embedding", "index": i, "embedding": embedding_of(str(text))}
            for i, text in enumerate(texts)
        ]
        usage = {"prompt_tokens": sum(len(str(t)) // 4 for t in texts), "total_tokens": 0}
        return web.json_response(
            {"object": "list", "data": data, "model": body.get("model", self.model), "usage": usage}
        )

    async def stop(self) -> None:
        """Stop the server (idempotent); in-flight delayed replies are cut short."""
        runner, self._runner = self._runner, None
        for task in self._sleeping:
            task.cancel()
        self._sleeping.clear()
        if runner is not None:
            await runner.cleanup()
        for _, waiter in self._waiters:
            if not waiter.done():
                waiter.cancel()
        self._waiters.clear()

    @property
    def base_url(self) -> str:
        if self._base_url is None:
            raise RuntimeError("ScriptedModel is not started")
        return self._base_url

    # -- scripting -------------------------------------------------------------------

    def expect(
        self, reply: Reply, *, check: Callable[[dict[str, Any]], object] | None = None
    ) -> None:
        """Queue one expected call (FIFO); ``check(request_json)`` runs when it arrives."""
        self._expectations.append(_Expectation(reply, check))

    def respond_with(self, responder: Responder | None) -> None:
        """Install (or with None remove) the fallback used when no expectation is queued."""
        self._responder = responder

    @property
    def pending(self) -> int:
        """Number of expectations not yet consumed."""
        return len(self._expectations)

    def assert_done(self) -> None:
        """Raise AssertionError listing every failure and unconsumed expectation."""
        problems = list(self.failures)
        problems.extend(
            f"unconsumed expectation #{index}: {expectation.reply.describe()}"
            for index, expectation in enumerate(self._expectations, start=1)
        )
        if problems:
            listing = "\n".join(f"  - {problem}" for problem in problems)
            raise AssertionError(f"scripted model: {len(problems)} problem(s):\n{listing}")

    async def wait_for_requests(self, n: int, timeout: float = 10.0) -> None:
        """Wait until at least ``n`` requests have arrived; AssertionError on timeout."""
        if len(self.requests) >= n:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, waiter)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            raise AssertionError(
                f"scripted model: {len(self.requests)} of {n} requests arrived within {timeout}s"
            ) from None
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    # -- HTTP handlers ---------------------------------------------------------------

    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _handle_models(self, request: web.Request) -> web.Response:
        payload = {
            "object": "list",
            "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "loopwire"}],
        }
        return web.Response(body=json.dumps(payload).encode(), content_type="application/json")

    async def _handle_chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            self.failures.append(f"request body is not JSON: {exc}")
            return _error_response(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            self.failures.append(f"request body is not a JSON object: {type(body).__name__}")
            return _error_response(400, "request body must be a JSON object")

        self.requests.append(body)
        number = len(self.requests)
        self._wake_waiters(number)

        reply = await self._choose_reply(number, body)
        if reply is None:
            return _error_response(500, f"scripted model: unexpected call #{number}")
        if reply.delay > 0:
            await self._sleep(reply.delay)
        if body.get("stream") is True and reply.kind == "completion":
            return await self._stream(request, self._completion(reply, body), reply, body)
        return self._render(reply, body)

    async def _stream(
        self,
        request: web.Request,
        completion: dict[str, Any],
        reply: Reply,
        body: dict[str, Any],
    ) -> web.StreamResponse:
        """The completion as server-sent events, as OpenAI streams it: the text in pieces of a
        few characters (about a token each), each tool call's id and name and then its
        arguments in pieces, the finish reason, the usage when ``stream_options.include_usage``
        asks, then ``[DONE]``."""
        self.streamed += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        options = body.get("stream_options")
        with_usage = isinstance(options, dict) and options.get("include_usage") is True
        for number, chunk in enumerate(stream_chunks(completion, with_usage)):
            if reply.cut_after is not None and number >= reply.cut_after:
                return response  # broken off: no final chunk, no [DONE]
            if number and reply.chunk_delay > 0:
                await self._sleep(reply.chunk_delay)
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _sleep(self, delay: float) -> None:
        task = asyncio.current_task()
        if task is None:
            await asyncio.sleep(delay)
            return
        self._sleeping.add(task)
        try:
            await asyncio.sleep(delay)
        finally:
            self._sleeping.discard(task)

    def _wake_waiters(self, count: int) -> None:
        if not self._waiters:
            return
        for n, waiter in self._waiters:
            if count >= n and not waiter.done():
                waiter.set_result(None)

    async def _choose_reply(self, number: int, body: dict[str, Any]) -> Reply | None:
        if self._expectations:
            expectation = self._expectations.popleft()
            if expectation.check is not None:
                try:
                    expectation.check(body)
                except Exception as exc:
                    self.failures.append(
                        f"check failed for call #{number} ({summarize(body)}): "
                        f"{type(exc).__name__}: {exc}"
                    )
            return expectation.reply
        responder = self._responder
        if responder is None:
            self.failures.append(f"unexpected call #{number}: {summarize(body)}")
            return None
        try:
            result = responder(body)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            self.failures.append(
                f"responder failed for call #{number} ({summarize(body)}): "
                f"{type(exc).__name__}: {exc}"
            )
            return None
        if not isinstance(result, Reply):
            self.failures.append(
                f"responder returned {type(result).__name__} instead of Reply for call #{number}"
            )
            return None
        return result

    def _render(self, reply: Reply, body: dict[str, Any]) -> web.Response:
        if reply.kind == "error":
            return _error_response(reply.status, reply.message, dict(reply.headers))
        if reply.kind == "garbage":
            return web.Response(
                status=reply.status, body=reply.body, content_type="application/json"
            )
        return web.Response(
            body=json.dumps(self._completion(reply, body)).encode(),
            content_type="application/json",
        )

    def _completion(self, reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.calls:
            message["tool_calls"] = [
                {
                    "id": call.call_id or f"call_{next(self._call_ids)}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments_json},
                }
                for call in reply.calls
            ]
        if reply.usage is not None:
            prompt_tokens, completion_tokens = reply.usage
        else:
            prompt_tokens = estimate_prompt_tokens(body)
            completion_tokens = max(1, len(reply.content or "") // 4 + 10 * len(reply.calls))
        model = body.get("model")
        return {
            "id": f"chatcmpl-{next(self._completion_ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model if isinstance(model, str) and model else self.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": reply.finish_reason
                    or ("tool_calls" if reply.calls else "stop"),
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }


async def _serve(host: str, port: int, model: str, echo: bool) -> None:
    server = ScriptedModel(model=model)
    if echo:
        server.respond_with(echo_responder)
    base_url = await server.start(host, port)
    print(f"scripted model listening on {base_url}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stopping.set)
    try:
        await stopping.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m worker.testing.scripted_model",
        description="Scripted OpenAI-compatible chat-completions server.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--model", default="scripted-model")
    parser.add_argument(
        "--echo",
        action="store_true",
        help='answer every request with "echo: <last user message content>"',
    )
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.host, args.port, args.model, args.echo))


if __name__ == "__main__":
    main()
