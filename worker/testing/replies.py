"""The replies a ``ScriptedModel`` is scripted with, and helpers that read a chat-completions
request (what the last message says, roughly how many tokens it has)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

_ReplyKind = Literal["completion", "error", "garbage"]
_SUMMARY_CHARS = 120


@dataclass(frozen=True, slots=True)
class _ToolCall:
    name: str
    arguments_json: str
    call_id: str | None


@dataclass(frozen=True, slots=True)
class Reply:
    """Immutable description of one response; build it with the static constructors."""

    kind: _ReplyKind
    content: str | None = None
    finish_reason: str | None = None
    calls: tuple[_ToolCall, ...] = ()
    usage: tuple[int, int] | None = None
    delay: float = 0.0
    status: int = 200
    message: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    chunk_delay: float = 0.0
    """Streamed (a request with ``stream: true``): seconds between chunks."""
    cut_after: int | None = None
    """Streamed: the stream breaks off after this many chunks (no final chunk, no [DONE])."""

    @staticmethod
    def text(
        content: str,
        *,
        usage: tuple[int, int] | None = None,
        delay: float = 0.0,
        finish_reason: str | None = None,
        chunk_delay: float = 0.0,
        cut_after: int | None = None,
    ) -> Reply:
        """A plain assistant message (finish_reason "stop" unless given, e.g. "length").
        Streamed when the request asks: ``chunk_delay`` between chunks, ``cut_after`` chunks
        before the stream breaks off."""
        return Reply(
            kind="completion",
            content=content,
            usage=usage,
            delay=delay,
            finish_reason=finish_reason,
            chunk_delay=chunk_delay,
            cut_after=cut_after,
        )

    @staticmethod
    def tool_calls(
        *calls: tuple[str, Mapping[str, object]] | tuple[str, Mapping[str, object], str],
        content: str | None = None,
        delay: float = 0.0,
    ) -> Reply:
        """One or more tool calls: each ``(name, arguments[, call_id])``."""
        if not calls:
            raise ValueError("Reply.tool_calls needs at least one call")
        specs = tuple(
            _ToolCall(
                name=call[0],
                arguments_json=json.dumps(dict(call[1])),
                call_id=call[2] if len(call) == 3 else None,
            )
            for call in calls
        )
        return Reply(kind="completion", content=content, calls=specs, delay=delay)

    @staticmethod
    def raw_tool_call(name: str, arguments_json: str, call_id: str | None = None) -> Reply:
        """A single tool call whose ``arguments`` string is sent verbatim (may be invalid JSON)."""
        return Reply(kind="completion", calls=(_ToolCall(name, arguments_json, call_id),))

    @staticmethod
    def error(
        status: int,
        message: str = "scripted error",
        *,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """An HTTP error with an OpenAI-style ``{"error": {...}}`` JSON body."""
        return Reply(
            kind="error",
            status=status,
            message=message,
            headers=tuple((headers or {}).items()),
        )

    @staticmethod
    def garbage(body: bytes = b"{not json", status: int = 200) -> Reply:
        """A response whose body is not valid JSON (served as application/json)."""
        return Reply(kind="garbage", status=status, body=body)

    def describe(self) -> str:
        if self.kind == "error":
            return f"error({self.status}, {self.message!r})"
        if self.kind == "garbage":
            return f"garbage({self.status}, {self.body[:40]!r})"
        if self.calls:
            names = ", ".join(call.name for call in self.calls)
            return f"tool_calls({names})"
        return f"text({_truncate(self.content or '', 60)!r})"


Responder = Callable[[dict[str, Any]], Reply | Awaitable[Reply]]


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [part.get("text") for part in content if isinstance(part, dict)]
        return "".join(part for part in parts if isinstance(part, str))
    return ""


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    return [message for message in messages if isinstance(message, dict)]


def summarize(body: dict[str, Any]) -> str:
    messages = _messages(body)
    if not messages:
        return "<no messages>"
    last = messages[-1]
    role = last.get("role", "?")
    text = _content_text(last.get("content"))
    if not text and last.get("tool_calls"):
        text = "<tool_calls>"
    return f"{role}: {_truncate(text, _SUMMARY_CHARS)!r}"


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    chars = sum(len(_content_text(message.get("content"))) for message in _messages(body))
    return max(1, chars // 4)


def last_user_content(body: dict[str, Any]) -> str:
    """The text of the last ``user`` message in a chat-completions request ("" if none)."""
    for message in reversed(_messages(body)):
        if message.get("role") == "user":
            return _content_text(message.get("content"))
    return ""


def echo_responder(body: dict[str, Any]) -> Reply:
    """Answer every request with ``echo: <last user message content>``."""
    return Reply.text(f"echo: {last_user_content(body)}")


EMBEDDING_DIMENSIONS = 64


def embedding_of(text: str) -> list[float]:
    """A unit vector of the text's words, each hashed into one of 64 dimensions: texts that
    share words point the same way. Deterministic: every server gives the same vector."""
    vector = [0.0] * EMBEDDING_DIMENSIONS
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        digest = hashlib.sha256(word.encode()).digest()
        vector[digest[0] % EMBEDDING_DIMENSIONS] += 1.0 if digest[1] % 2 else -1.0
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]
