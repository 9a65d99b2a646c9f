"""The model behind the loop: any OpenAI-compatible chat-completions endpoint.

The ``openai`` client is kept for its typed errors, its retries (429 and 5xx,
with backoff, honouring ``Retry-After``) and its bounded timeouts. What it costs
per call is not: ``chat.completions.create`` transforms the whole request
recursively on every call, and even
``client.post`` with a dict body serializes it through the client and then
builds typed pydantic models from the answer. So the adapter

- builds the body from loopwire's own already-validated messages (the stored
  history as the store decoded it, ``worker.loop.transcript``) and encodes it
  to JSON once (the bytes go to the client as ``content``: a replayable body, so
  the client's retries resend the very same bytes);
- asks the client for the raw ``httpx2.Response`` (``cast_to``), so the
  status handling, retries and error types are still the client's, and reads
  the few fields it needs from the body itself. It calls ``client.request``
  with the options ``client.post`` would build (``worker.model.http``).

While the model thinks, the encoded body is the one copy of the request a turn
holds (``complete`` encodes it before it returns the awaitable, so the caller's
messages are not kept for the call), and once sent it is held compressed
(``worker.model.http.HeldBody``) for the client's retries.

The HTTP transport is chosen where the client is built (``worker.app``): the
client's aiohttp transport (``openai.DefaultAioHttpClient``), cheaper per call than
httpx's own connection pool and more so under many concurrent calls;
``tests/bench`` measures every variant (``--scenario adapter``).

A 200 response whose body is not JSON, or not a chat completion, is not retried
by the client; this adapter retries it a bounded number of times and then fails
the turn with ``model_bad_response``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable
from typing import Any

import httpx2
import openai
import orjson
from openai import AsyncOpenAI

from contracts.messages import ChatMessage, ToolCall, Usage
from contracts.state import ModelResponse
from worker.errors import ModelError
from worker.loop.ports import ModelRequest, TextStream
from worker.loop.transcript import wire_messages
from worker.model.http import ChatOptions, chat_options, retry_after_s
from worker.model.sse import read_stream

log = logging.getLogger("loopwire.model")

RATE_LIMIT_BACKOFF_S = 2.0
"""How long a turn waits after a 429 that says nothing of how long to wait."""


def build_body(request: ModelRequest, default_model: str, *, plain: bool = True) -> dict[str, Any]:
    """The request body; unless ``plain``, messages already encoded are ``orjson.Fragment``."""
    body: dict[str, Any] = {
        "model": request.model or default_model,
        "messages": wire_messages(request.messages, plain=plain),
    }
    if request.tools:
        body["tools"] = [tool.to_openai() for tool in request.tools]
    if request.temperature is not None:
        body["temperature"] = request.temperature
    if request.max_tokens is not None:
        body["max_tokens"] = request.max_tokens
    if request.response_format is not None:
        body["response_format"] = request.response_format
    if request.stream is not None:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    body.update(request.extra)
    return body


def encode_body(request: ModelRequest, default_model: str) -> bytes:
    """The request as JSON bytes, encoded once (compact UTF-8, what the client sends).

    orjson, for its speed; its output buffer is larger than the JSON, and the body is kept for
    the whole model call (retries resend it), so it is copied to its exact size. What orjson
    cannot encode (an integer past 64 bits in a tool schema) goes through the standard
    encoder. Messages the worker encoded for an earlier step (``worker.loop.transcript.Encoded``)
    go in as they are."""
    try:
        return memoryview(orjson.dumps(build_body(request, default_model, plain=False))).tobytes()
    except orjson.JSONEncodeError:
        body = build_body(request, default_model)
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def parse_completion(data: Any, elapsed: float) -> ModelResponse:
    """A chat completion (decoded JSON) as a ``ModelResponse``; ``ValueError`` when it is not one."""
    if not isinstance(data, dict):
        raise ValueError(f"the response is a JSON {type(data).__name__}, not an object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ValueError("the response has no choices")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise ValueError("the first choice has no message")
    calls = tuple(
        _tool_call(call) for call in message.get("tool_calls") or () if _is_function(call)
    )
    usage = data.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    return ModelResponse(
        message=ChatMessage(role="assistant", content=message.get("content"), tool_calls=calls),
        finish_reason=choice.get("finish_reason") or ("tool_calls" if calls else "stop"),
        usage=Usage(
            prompt_tokens=usage.get("prompt_tokens") or 0,
            completion_tokens=usage.get("completion_tokens") or 0,
            total_tokens=usage.get("total_tokens") or 0,
        ),
        model=data.get("model") or "",
        response_id=data.get("id"),
        duration_s=elapsed,
    )


def _is_function(call: Any) -> bool:
    if not isinstance(call, dict):
        raise ValueError("a tool call is not an object")
    return bool(call.get("type", "function") == "function")


def _tool_call(call: dict[str, Any]) -> ToolCall:
    function = call.get("function")
    if not isinstance(function, dict):
        raise ValueError("a tool call has no function")
    return ToolCall(
        id=call.get("id"), name=function.get("name"), arguments=function.get("arguments") or "{}"
    )


class OpenAIModel:
    """``Model`` over an ``openai.AsyncOpenAI`` client."""

    def __init__(
        self,
        client: AsyncOpenAI,
        *,
        model: str,
        bad_response_retries: int = 2,
        provider: str | None = None,
    ) -> None:
        self.client = client
        self.default_model = model
        self.bad_response_retries = bad_response_retries
        self.provider = provider
        """Recorded on each answer (``ModelResponse.provider``); ``None`` for ``default``."""

    def complete(self, request: ModelRequest) -> Awaitable[ModelResponse]:
        """Encode the request now; the answer comes from the returned awaitable, which holds
        only the encoded body (the client's retries resend those very bytes)."""
        body = encode_body(request, self.default_model)
        return self._send(chat_options(body, request.timeout_s), request.stream)

    async def _send(self, options: ChatOptions, stream: TextStream | None) -> ModelResponse:
        attempts = self.bad_response_retries + 1
        for attempt in range(1, attempts + 1):
            started = time.monotonic()
            try:
                if stream is None:
                    response = await self.client.request(httpx2.Response, options)
                    answer = parse_completion(
                        orjson.loads(response.content), time.monotonic() - started
                    )
                else:
                    answer = await self._streamed(options, stream, started)
                if self.provider is not None:
                    answer = answer.model_copy(update={"provider": self.provider})
                return answer
            except openai.APIStatusError as exc:
                raise ModelError(
                    f"model endpoint answered {exc.status_code}: {_short(exc.message)}",
                    code=f"model_http_{exc.status_code}",
                    retry_after=(
                        retry_after_s(exc.response.headers) or RATE_LIMIT_BACKOFF_S
                        if exc.status_code == 429
                        else None
                    ),
                ) from exc
            except (
                openai.APITimeoutError,
                openai.APIConnectionError,
                httpx2.TransportError,
            ) as exc:
                # (a transport error: a stream that broke off while it was being read)
                raise ModelError(
                    f"model endpoint unreachable: {_short(unreachable(exc))}",
                    code="model_unavailable",
                ) from exc
            except (ValueError, TypeError) as exc:  # json, shape, and pydantic validation errors
                log.warning(
                    "malformed model response (attempt %d of %d): %s", attempt, attempts, exc
                )
                if attempt == attempts:
                    raise ModelError(
                        f"the model endpoint sent {attempts} malformed responses: {_short(str(exc))}",
                        code="model_bad_response",
                    ) from exc
        raise AssertionError("unreachable")

    async def _streamed(
        self, options: ChatOptions, stream: TextStream, started: float
    ) -> ModelResponse:
        """One streamed attempt (``worker.model.sse``); the client's retries (5xx, dropped
        connections) happen before the first byte of the answer, as for a whole one."""
        stream.begin()
        raw: Any = await self.client.request(httpx2.Response, options, stream=True)
        response: httpx2.Response = raw
        try:
            answer = await read_stream(response, stream, started)
        finally:
            await response.aclose()
        if answer is None:  # the server sent the whole completion instead
            answer = parse_completion(orjson.loads(response.content), time.monotonic() - started)
            await stream.text(answer.message.content or "")
            await stream.end()
        return answer


def unreachable(exc: BaseException) -> str:
    """Why the endpoint was not reached. The aiohttp transport reports every connection that
    could not be made as ``ConnectTimeout``, which the ``openai`` client words "Request timed
    out."; the error the system gave underneath says what happened (a refused connection, a
    name that does not resolve), with the transport's message naming the address."""
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and all(cause is not seen for seen in chain):
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    transport = chain[1] if len(chain) > 1 else exc
    if any(isinstance(cause, ConnectionRefusedError) for cause in chain):
        return f"connection refused ({transport})"
    system = [c for c in chain if isinstance(c, OSError) and not isinstance(c, TimeoutError)]
    if system:  # the deepest: the system's own words
        return f"cannot connect: {system[-1].strerror or system[-1]} ({transport})"
    return str(exc)


def _short(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
