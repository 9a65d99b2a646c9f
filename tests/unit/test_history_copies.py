"""The pieces of a worker's history copies (``worker.session.history_cache``) that need no
Redis: the bound on what the copies hold, and a request built from messages encoded in an
earlier step being the same bytes as one encoded afresh."""

from __future__ import annotations

from typing import Any

import orjson

from contracts.messages import ChatMessage, ToolCall
from worker.loop.ports import ModelRequest
from worker.loop.transcript import Encoded, StoredMessages, Transcript
from worker.model.adapter import encode_body
from worker.sequencing.erasure import forgetting
from worker.session.history_cache import HELD_PER_STORED_BYTE, Copy, HistoryCache


def copy_of(size: int) -> Copy:
    return Copy("g", 1, [{"role": "user", "content": "x"}], size)


def test_copies_are_kept_from_their_least_size_and_the_least_recently_used_go_first() -> None:
    cache = HistoryCache(max_bytes=100 * HELD_PER_STORED_BYTE, min_bytes=10)
    assert cache.put("small", copy_of(9)) is None
    a, b = cache.put("a", copy_of(40)), cache.put("b", copy_of(40))
    assert a is not None and b is not None
    assert cache.get("a") is a  # used: "b" is now the least recently used
    c = cache.put("c", copy_of(40))
    assert c is not None and cache.get("b") is None and cache.get("a") is a
    assert cache.held == 80 * HELD_PER_STORED_BYTE
    cache.grew(a, [{"role": "user", "content": "y"}], 1, 30)  # 110 > 100: "c" goes
    assert cache.get("c") is None and len(cache) == 1 and a.items == 2
    assert cache.put("huge", copy_of(101)) is None  # more than the bound on its own
    cache.drop("a")
    assert cache.held == 0


def stored() -> list[dict[str, Any]]:
    call = ToolCall(id="c1", name="lookup", arguments='{"q": "ünï \\"x\\""}')
    messages = [
        ChatMessage(role="user", content="find it"),
        ChatMessage(role="assistant", content=None, tool_calls=(call,)),
        ChatMessage(role="tool", content='{"items": ["a", "\\u2028"]}', tool_call_id="c1"),
        ChatMessage(role="assistant", content="found"),
    ]
    return [m.model_dump(mode="json") for m in messages]


def test_a_request_from_encoded_messages_is_the_bytes_of_one_encoded_afresh() -> None:
    raw = stored()
    slots: list[orjson.Fragment | None] = [None] * 3  # the copy holds the first three
    system = ChatMessage(role="system", content="be brief")
    fresh = encode_body(ModelRequest(messages=Transcript(system, StoredMessages(raw))), "m")
    for _ in range(2):  # encoded on the first request, reused by the second
        history = StoredMessages(list(raw), Encoded(slots, 0, 3))
        body = encode_body(ModelRequest(messages=Transcript(system, history)), "m")
        assert body == fresh
    assert all(slot is not None for slot in slots)
    tail = StoredMessages(list(raw), Encoded(slots, 0, 3)).tail(2)  # a context window's cut
    cut = encode_body(ModelRequest(messages=Transcript(system, tail)), "m")
    assert cut == encode_body(
        ModelRequest(messages=Transcript(system, StoredMessages(raw[2:]))), "m"
    )
    assert [m["role"] for m in orjson.loads(cut)["messages"]] == ["system", "tool", "assistant"]


def test_a_request_orjson_cannot_encode_falls_back_without_the_encoded_messages() -> None:
    raw = stored()
    slots: list[orjson.Fragment | None] = [None] * 4
    history = StoredMessages(list(raw), Encoded(slots, 0, 4))
    request = ModelRequest(messages=Transcript(None, history), extra={"seed": 1 << 70})
    body = orjson.loads(encode_body(request, "m"))
    assert body["seed"] == 1 << 70
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool", "assistant"]


def test_a_copy_unused_for_its_idle_time_goes() -> None:
    now = [0.0]
    cache = HistoryCache(1 << 20, 0, idle_s=300, clock=lambda: now[0])
    a, b = cache.put("a", copy_of(10)), cache.put("b", copy_of(10))
    now[0] = 200.0
    assert cache.get("a") is a  # used again: its idle time starts over
    now[0] = 350.0
    assert cache.get("b") is None and cache.get("a") is a and cache.held == 10 * 3
    assert b is not None


async def test_the_worker_that_erases_a_session_forgets_its_copy() -> None:
    cache = HistoryCache(1 << 20, 0)
    cache.put("s-1", copy_of(10))
    cache.put("s-2", copy_of(10))
    assert await forgetting(cache, None)("s-1") == 0
    assert cache.get("s-1") is None and cache.get("s-2") is not None
