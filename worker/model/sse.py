"""A streamed chat completion (``stream: true``): server-sent events read from the raw response,
assembled into the same ``ModelResponse`` a whole completion gives.

Text pieces go to the step's ``TextStream`` as they arrive; tool-call pieces (id and name
first, then the arguments in fragments, keyed by ``index``) are assembled here and never
published. Usage comes in the last chunk (``stream_options.include_usage``, which the adapter
asks for). A server that answers a streaming request with a whole completion
(``application/json``) is read as one: its text goes to the stream as one piece. A stream
that breaks off before ``[DONE]`` (or the final chunk) is malformed, as is a chunk that is not
a JSON object; an ``error`` object in the stream is the endpoint's error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx2
import orjson

from contracts.messages import ChatMessage, ToolCall, Usage
from contracts.state import ModelResponse
from worker.loop.ports import TextStream


class StreamError(ValueError):
    """The endpoint reported an error inside the stream (after its 200)."""


@dataclass(slots=True)
class _Call:
    id: str | None = None
    name: str | None = None
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Answer:
    text: list[str] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    response_id: str | None = None
    done: bool = False

    def add(self, chunk: Any) -> str:
        """Take one chunk in; the text it adds."""
        if not isinstance(chunk, dict):
            raise ValueError(f"a stream chunk is a JSON {type(chunk).__name__}, not an object")
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise StreamError(f"the model endpoint reported an error in the stream: {message}")
        self.model = chunk.get("model") or self.model
        self.response_id = chunk.get("id") or self.response_id
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        piece = ""
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise ValueError("a stream chunk's delta is not an object")
            content = delta.get("content")
            if isinstance(content, str) and content:
                self.text.append(content)
                piece += content
            for call in delta.get("tool_calls") or ():
                self._add_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return piece

    def _add_call(self, call: Any) -> None:
        if not isinstance(call, dict):
            raise ValueError("a tool call delta is not an object")
        if call.get("type", "function") != "function":
            return
        slot = self.calls.setdefault(int(call.get("index", 0)), _Call())
        slot.id = call.get("id") or slot.id
        function = call.get("function") or {}
        if not isinstance(function, dict):
            raise ValueError("a tool call delta's function is not an object")
        slot.name = function.get("name") or slot.name
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            slot.arguments.append(arguments)

    def response(self, elapsed: float) -> ModelResponse:
        if not self.done and self.finish_reason is None:
            raise ValueError("the stream ended before the answer was complete")
        calls = tuple(
            ToolCall(id=c.id, name=c.name, arguments="".join(c.arguments) or "{}")
            for _, c in sorted(self.calls.items())
        )
        text = "".join(self.text)
        usage = self.usage
        return ModelResponse(
            message=ChatMessage(role="assistant", content=text or None, tool_calls=calls),
            finish_reason=self.finish_reason or ("tool_calls" if calls else "stop"),
            usage=Usage(
                prompt_tokens=usage.get("prompt_tokens") or 0,
                completion_tokens=usage.get("completion_tokens") or 0,
                total_tokens=usage.get("total_tokens") or 0,
            ),
            model=self.model,
            response_id=self.response_id,
            duration_s=elapsed,
        )


async def read_stream(
    response: httpx2.Response, stream: TextStream, started: float
) -> ModelResponse | None:
    """The streamed answer, its text sent to ``stream`` as it arrives; ``None`` when the
    server answered with a whole completion instead (the caller parses it)."""
    if "text/event-stream" not in response.headers.get("content-type", ""):
        await response.aread()
        return None
    answer = _Answer()
    data: list[str] = []
    async for line in response.aiter_lines():
        if line:
            if line.startswith("data:"):
                data.append(line[6:] if line.startswith("data: ") else line[5:])
            continue  # comments, event names and ids say nothing here
        if not data:
            continue
        payload, data = "\n".join(data), []
        if payload.strip() == "[DONE]":
            answer.done = True
            break
        piece = answer.add(orjson.loads(payload))
        if piece:
            await stream.text(piece)
    if data and not answer.done:  # the last event without its blank line
        payload = "\n".join(data)
        if payload.strip() == "[DONE]":
            answer.done = True
        else:
            piece = answer.add(orjson.loads(payload))
            if piece:
                await stream.text(piece)
    result = answer.response(time.monotonic() - started)
    await stream.end()
    return result
