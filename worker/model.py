"""The model behind the loop: any OpenAI-compatible chat-completions endpoint.

The ``openai`` client is kept for its typed errors, its retries (429 and 5xx,
with backoff) and its bounded timeouts. The request body is built here from
loopwire's own already-validated messages and posted with ``client.post``, which
skips the per-call recursive transformation that ``chat.completions.create``
applies to every message of the history.

A 200 response whose body is not JSON, or not a chat completion, is not retried
by the client; this adapter retries it a bounded number of times and then fails
the turn with ``model_bad_response``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import openai
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion

from contracts.messages import ChatMessage, ToolCall, Usage
from contracts.state import ModelResponse
from worker.errors import ModelError
from worker.loop.interfaces import ModelRequest

log = logging.getLogger("loopwire.model")


def message_to_openai(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.role == "assistant" and message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def build_body(request: ModelRequest, default_model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": request.model or default_model,
        "messages": [message_to_openai(m) for m in request.messages],
    }
    if request.tools:
        body["tools"] = [tool.to_openai() for tool in request.tools]
    if request.temperature is not None:
        body["temperature"] = request.temperature
    if request.max_tokens is not None:
        body["max_tokens"] = request.max_tokens
    if request.response_format is not None:
        body["response_format"] = request.response_format
    body.update(request.extra)
    return body


def parse_completion(completion: ChatCompletion, elapsed: float) -> ModelResponse:
    if not completion.choices:
        raise ValueError("the response has no choices")
    choice = completion.choices[0]
    calls = tuple(
        ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments or "{}")
        for call in (choice.message.tool_calls or ())
        if call.type == "function"
    )
    usage = completion.usage
    return ModelResponse(
        message=ChatMessage(role="assistant", content=choice.message.content, tool_calls=calls),
        finish_reason=choice.finish_reason or ("tool_calls" if calls else "stop"),
        usage=Usage(
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            total_tokens=usage.total_tokens if usage else 0,
        ),
        model=completion.model or "",
        response_id=completion.id,
        duration_s=elapsed,
    )


class OpenAIModel:
    """``Model`` over an ``openai.AsyncOpenAI`` client."""

    def __init__(self, client: AsyncOpenAI, *, model: str, bad_response_retries: int = 2) -> None:
        self.client = client
        self.default_model = model
        self.bad_response_retries = bad_response_retries

    async def complete(self, request: ModelRequest) -> ModelResponse:
        body = build_body(request, self.default_model)
        attempts = self.bad_response_retries + 1
        for attempt in range(1, attempts + 1):
            started = time.monotonic()
            try:
                completion = await self.client.post(
                    "/chat/completions", body=body, cast_to=ChatCompletion
                )
                return parse_completion(completion, time.monotonic() - started)
            except openai.APIStatusError as exc:
                raise ModelError(
                    f"model endpoint answered {exc.status_code}: {_short(exc.message)}",
                    code=f"model_http_{exc.status_code}",
                ) from exc
            except (openai.APITimeoutError, openai.APIConnectionError) as exc:
                raise ModelError(
                    f"model endpoint unreachable: {_short(str(exc))}", code="model_unavailable"
                ) from exc
            except (
                ValueError,
                TypeError,
                AttributeError,
                openai.APIResponseValidationError,
            ) as exc:
                log.warning(
                    "malformed model response (attempt %d of %d): %s", attempt, attempts, exc
                )
                if attempt == attempts:
                    raise ModelError(
                        f"the model endpoint sent {attempts} malformed responses: {_short(str(exc))}",
                        code="model_bad_response",
                    ) from exc
        raise AssertionError("unreachable")


def _short(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
