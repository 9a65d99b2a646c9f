"""The messages of one model request, decoded no further than the request needs.

A step sends the whole conversation to the model: with a long history,
validating every stored message into a ``ChatMessage`` again (the store
validated each on the way in) costs more CPU than encoding the request. So the
store hands the history over as the plain data it decoded (``StoredMessages``),
the adapter turns that into the chat-completions shape directly (``wire``), and
``ChatMessage`` objects are built only when something reads the messages as
such — a hook that rewrites them, or a test.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import orjson
from pydantic import TypeAdapter

from contracts.messages import ChatMessage

_CHAT: TypeAdapter[list[ChatMessage]] = TypeAdapter(list[ChatMessage])


def to_wire(message: ChatMessage) -> dict[str, Any]:
    """A message in the chat-completions request shape."""
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


def stored_to_wire(message: dict[str, Any]) -> dict[str, Any]:
    """``to_wire`` for a message as stored (``ChatMessage`` dumped to plain data)."""
    role = message["role"]
    out: dict[str, Any] = {"role": role, "content": message.get("content")}
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        out["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call.get("arguments", "{}")},
            }
            for call in calls
        ]
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("name") is not None:
        out["name"] = message["name"]
    return out


def call_ids(history: Sequence[ChatMessage], start: int) -> frozenset[str]:
    """The ids of the tool calls the assistant messages of ``history[start:]`` asked for (the
    turn's calls so far, when ``start`` is where the turn began), read as the store decoded
    them."""
    if isinstance(history, StoredMessages):
        return frozenset(
            call["id"]
            for m in history.raw[start:]
            if m.get("role") == "assistant"
            for call in m.get("tool_calls") or ()
        )
    return frozenset(
        call.id for m in history[start:] if m.role == "assistant" for call in m.tool_calls
    )


class _Lazy(Sequence[ChatMessage]):
    """A message sequence that builds its ``ChatMessage`` objects on first read."""

    _chat: list[ChatMessage] | None = None

    def _messages(self) -> list[ChatMessage]:
        raise NotImplementedError

    def _all(self) -> list[ChatMessage]:
        if self._chat is None:
            self._chat = self._messages()
        return self._chat

    @overload
    def __getitem__(self, index: int) -> ChatMessage: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[ChatMessage]: ...
    def __getitem__(self, index: int | slice) -> ChatMessage | Sequence[ChatMessage]:
        return self._all()[index]

    def __iter__(self) -> Iterator[ChatMessage]:
        return iter(self._all())

    def wire(self, *, plain: bool = False) -> list[Any]:
        raise NotImplementedError


class Encoded:
    """The request JSON of stored messages, each encoded once: slots ``base`` to
    ``base + count`` of ``slots`` belong to a list's first ``count`` messages. The slots are a
    worker's cached history's (``worker.session.history_cache``), so a message is encoded for
    the first request that sends it and reused by every later step of the turn."""

    __slots__ = ("base", "count", "slots")

    def __init__(self, slots: list[orjson.Fragment | None], base: int, count: int) -> None:
        self.slots = slots
        self.base = base
        self.count = count

    def after(self, start: int) -> Encoded:
        return Encoded(self.slots, self.base + start, max(0, self.count - start))

    def wire(self, raw: list[dict[str, Any]]) -> list[Any]:
        slots, base, count = self.slots, self.base, self.count
        out: list[Any] = []
        for i, message in enumerate(raw):
            if i >= count:
                out.append(stored_to_wire(message))
                continue
            fragment = slots[base + i]
            if fragment is None:
                fragment = slots[base + i] = orjson.Fragment(orjson.dumps(stored_to_wire(message)))
            out.append(fragment)
        return out


class StoredMessages(_Lazy):
    """Messages as the store decoded them (plain data of dumped ``ChatMessage`` objects), with
    their request JSON when the worker keeps it (``Encoded``)."""

    def __init__(self, raw: list[dict[str, Any]], encoded: Encoded | None = None) -> None:
        self.raw = raw
        self.encoded = encoded

    def __len__(self) -> int:
        return len(self.raw)

    def _messages(self) -> list[ChatMessage]:
        return _CHAT.validate_python(self.raw)

    def tail(self, start: int) -> StoredMessages:
        """The messages from ``start`` on."""
        encoded = self.encoded.after(start) if self.encoded is not None else None
        return StoredMessages(list(self.raw[start:]), encoded)

    def wire(self, *, plain: bool = False) -> list[Any]:
        """The messages in the request shape; unless ``plain``, the ones already encoded as
        ``orjson.Fragment`` (for ``orjson.dumps`` only)."""
        if self.encoded is not None and not plain:
            return self.encoded.wire(self.raw)
        return [stored_to_wire(m) for m in self.raw]


class Transcript(_Lazy):
    """What the model is sent: an optional system prompt, then the conversation so far."""

    def __init__(self, system: ChatMessage | None, history: Sequence[ChatMessage]) -> None:
        self.system = system
        self.history = history

    def __len__(self) -> int:
        return len(self.history) + (1 if self.system is not None else 0)

    def _messages(self) -> list[ChatMessage]:
        head = [self.system] if self.system is not None else []
        return [*head, *self.history]

    def wire(self, *, plain: bool = False) -> list[Any]:
        head = [to_wire(self.system)] if self.system is not None else []
        history = self.history
        if isinstance(history, _Lazy):
            return [*head, *history.wire(plain=plain)]
        return [*head, *(to_wire(m) for m in history)]


def wire_messages(messages: Sequence[ChatMessage], *, plain: bool = False) -> list[Any]:
    """Any message sequence in the chat-completions shape, without building what it need not;
    unless ``plain``, messages already encoded come as ``orjson.Fragment`` (``Encoded``)."""
    if isinstance(messages, _Lazy):
        return messages.wire(plain=plain)
    return [to_wire(m) for m in messages]
