"""A chat completion as an OpenAI-compatible server streams it (``stream: true``): the chunks
the scripted model sends as server-sent events."""

from __future__ import annotations

from typing import Any

TOKEN_CHARS = 4
"""The characters of one streamed text piece (about a token)."""


def stream_chunks(completion: dict[str, Any], with_usage: bool) -> list[dict[str, Any]]:
    """A chat completion as the chunks of its stream."""
    base = {
        "id": completion["id"],
        "object": "chat.completion.chunk",
        "created": completion["created"],
        "model": completion["model"],
    }
    choice = completion["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    text = message.get("content") or ""
    chunks += [
        chunk({"content": text[i : i + TOKEN_CHARS]}) for i in range(0, len(text), TOKEN_CHARS)
    ]
    for index, call in enumerate(message.get("tool_calls") or ()):
        head = {"index": index, "id": call["id"], "type": "function"}
        chunks.append(
            chunk({"tool_calls": [{**head, "function": {"name": call["function"]["name"]}}]})
        )
        arguments = call["function"]["arguments"]
        chunks += [
            chunk(
                {"tool_calls": [{"index": index, "function": {"arguments": arguments[i : i + 8]}}]}
            )
            for i in range(0, len(arguments), 8)
        ]
    chunks.append(chunk({}, choice["finish_reason"]))
    if with_usage:
        chunks.append({**base, "choices": [], "usage": completion["usage"]})
    return chunks
