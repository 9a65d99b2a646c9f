"""The msgpack codec against hostile bytes, and round-trips of every public contract.

Every bad input must come out as one ``DecodeError`` with a readable ``reason``
and a ``code`` (``malformed``, ``oversize`` or ``schema``), and no length header
may make the decoder allocate what the header claims.
"""

from __future__ import annotations

import contextlib
import json
import random
import struct
import tracemalloc
from collections.abc import Callable
from functools import partial
from typing import Any

import msgpack
import pytest
from pydantic import BaseModel

from contracts.codec import (
    MAX_CONTAINER_ITEMS,
    MAX_DEPTH,
    MAX_MESSAGE_BYTES,
    DecodeError,
    decode,
    decode_obj,
    encode,
    encode_obj,
    encode_stored,
    read_stored,
)
from contracts.events import (
    EVENT_TYPES,
    ApprovalDecided,
    ApprovalRequested,
    BudgetExhausted,
    Event,
    EventData,
    StepCompleted,
    ToolInvoked,
    ToolInvoking,
    TurnAccepted,
    TurnFinished,
    TurnRejected,
    TurnStarted,
    make_event,
)
from contracts.messages import ChatMessage, ToolCall, Usage
from contracts.state import (
    AgentState,
    AgentStep,
    ExecutionState,
    LLMOverrides,
    ModelResponse,
    PendingStep,
    SessionContext,
    StepExecution,
    StopSignal,
    ToolExecution,
)
from contracts.tools import (
    ToolAnnouncement,
    ToolCallReply,
    ToolCallRequest,
    ToolContext,
    ToolDefinition,
)
from contracts.turns import (
    InputMessage,
    LimitOverrides,
    LoopLimits,
    TurnError,
    TurnRequest,
    TurnResult,
)
from tests.unit.event_samples import LATER_EVENT_DATA

ONE_MB = 1024 * 1024
ALL_32_BITS = 2**32 - 1  # the largest count a 32-bit msgpack header can claim


# --------------------------------------------------------------------------- helpers


def pack(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def request_dict(**changes: Any) -> dict[str, Any]:
    """A valid TurnRequest as plain msgpack-able data."""
    data: dict[str, Any] = {
        "turn_id": "T1",
        "session_id": "S1",
        "agent": "support",
        "input": [{"role": "user", "content": "hi"}],
    }
    data.update(changes)
    return data


def nested_dicts(levels: int) -> dict[str, Any]:
    """``levels`` dicts nested inside each other: ``{"a": {"a": ... {}}}``."""
    node: dict[str, Any] = {}
    for _ in range(levels - 1):
        node = {"a": node}
    return node


def nested_lists(levels: int) -> list[Any]:
    node: list[Any] = []
    for _ in range(levels - 1):
        node = [node]
    return node


def decode_error(
    data: bytes,
    model: type[BaseModel] = TurnRequest,
    *,
    code: str,
    words: tuple[str, ...] = (),
    **kwargs: Any,
) -> DecodeError:
    """Decode ``data``; assert it fails with one readable ``DecodeError`` of ``code``."""
    with pytest.raises(DecodeError) as info:
        decode(data, model, **kwargs)
    error = info.value
    assert isinstance(error, ValueError)
    assert error.code == code, f"code {error.code!r} for reason {error.reason!r}"
    assert error.reason == str(error)
    assert error.reason.strip(), "the reason must not be empty"
    assert "\n" not in error.reason, "the reason must be one line"
    assert len(error.reason) <= 1100, "the reason must stay short"
    lowered = error.reason.lower()
    for word in words:
        assert word.lower() in lowered, f"{word!r} not in reason {error.reason!r}"
    return error


def peak_memory(action: Callable[[], object]) -> int:
    """Peak traced allocation (bytes) while running ``action``."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _decode_silently(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode(data, TurnRequest)


def _outcome(data: bytes) -> TurnRequest | DecodeError:
    """The decoded request, or the DecodeError; any other exception propagates."""
    try:
        return decode(data, TurnRequest)
    except DecodeError as error:
        return error


# --------------------------------------------------------------------------- empty, truncated, trailing


def test_empty_bytes() -> None:
    decode_error(b"", code="malformed", words=("empty",))


def test_every_prefix_of_a_valid_request_is_rejected() -> None:
    data = encode(TurnRequest.model_validate(request_dict(metadata={"k": [1, "two", None]})))
    assert decode(data, TurnRequest).turn_id == "T1"
    for cut in range(len(data)):
        error = decode_error(data[:cut], code="malformed")
        if cut == 0:
            assert "empty" in error.reason
        else:
            assert "msgpack" in error.reason
            assert "incomplete" in error.reason or "exceeds" in error.reason, error.reason


@pytest.mark.parametrize("extra", [b"\x00", b"\xc0", b"\x80", b"garbage", b"\x81\xa1a\x01"])
def test_trailing_bytes(extra: bytes) -> None:
    data = pack(request_dict()) + extra
    decode_error(data, code="malformed", words=("trailing",))


# --------------------------------------------------------------------------- length headers that lie


LYING_HEADERS = {
    "array32": b"\xdd" + struct.pack(">I", ALL_32_BITS),
    "map32": b"\xdf" + struct.pack(">I", ALL_32_BITS),
    "str32": b"\xdb" + struct.pack(">I", ALL_32_BITS),
    "bin32": b"\xc6" + struct.pack(">I", ALL_32_BITS),
    "ext32": b"\xc9" + struct.pack(">I", ALL_32_BITS) + b"\x01",
    "array16": b"\xdc\xff\xff",
    "map16": b"\xde\xff\xff",
    "str16": b"\xda\xff\xff",
}


@pytest.mark.parametrize("header", LYING_HEADERS.values(), ids=LYING_HEADERS.keys())
def test_header_claiming_huge_length_is_rejected(header: bytes) -> None:
    error = decode_error(header, code="malformed", words=("msgpack",))
    assert any(word in error.reason for word in ("exceeds", "incomplete")), error.reason


@pytest.mark.parametrize("header", LYING_HEADERS.values(), ids=LYING_HEADERS.keys())
def test_header_claiming_huge_length_allocates_nothing_big(header: bytes) -> None:
    padded = header + b"\x00" * 64
    nested = b"\x81\xa8metadata" + header  # inside a map, as a field value
    for data in (header, padded, nested):
        peak = peak_memory(partial(_decode_silently, data))
        assert peak < ONE_MB, f"decoding {data[:8].hex()} peaked at {peak} bytes"


def test_header_claiming_more_items_than_the_container_limit() -> None:
    count = MAX_CONTAINER_ITEMS + 1
    data = b"\xdd" + struct.pack(">I", count) + b"\xc0" * count  # a real array of nils
    error = decode_error(data, code="malformed", words=("exceeds",))
    assert "max_array_len" in error.reason


def test_header_claiming_huge_length_via_decode_obj() -> None:
    with pytest.raises(DecodeError) as info:
        decode_obj(LYING_HEADERS["str32"])
    assert info.value.code == "malformed"


# --------------------------------------------------------------------------- nesting


@pytest.mark.parametrize(
    "data",
    [
        b"\x91" * 5000 + b"\xc0",  # 5000 nested one-element arrays
        b"\x81\xa1a" * 5000 + b"\xc0",  # 5000 nested one-entry maps
        b"\x91" * 100_000,  # deep and truncated
    ],
    ids=["arrays", "maps", "arrays-truncated"],
)
def test_nesting_beyond_msgpacks_own_stack(data: bytes) -> None:
    error = decode_error(data, code="malformed")
    assert "nest" in error.reason or "incomplete" in error.reason, error.reason


def test_nesting_beyond_max_depth_inside_metadata() -> None:
    data = pack(request_dict(metadata=nested_dicts(40)))
    decode_error(data, code="malformed", words=("nests deeper", str(MAX_DEPTH)))


def test_nesting_of_lists_beyond_max_depth_inside_metadata() -> None:
    data = pack(request_dict(metadata={"k": nested_lists(40)}))
    decode_error(data, code="malformed", words=("nests deeper",))


def test_depth_limit_boundary() -> None:
    """The top-level container is depth 0; a container at depth MAX_DEPTH is one too many."""
    assert decode_obj(pack(nested_lists(MAX_DEPTH))) == nested_lists(MAX_DEPTH)
    with pytest.raises(DecodeError, match="nests deeper"):
        decode_obj(pack(nested_lists(MAX_DEPTH + 1)))
    # the request map is depth 0 and metadata depth 1, so metadata may hold MAX_DEPTH - 1 levels
    ok = decode(pack(request_dict(metadata=nested_dicts(MAX_DEPTH - 1))), TurnRequest)
    assert ok.metadata == nested_dicts(MAX_DEPTH - 1)
    decode_error(
        pack(request_dict(metadata=nested_dicts(MAX_DEPTH))), code="malformed", words=("nests",)
    )


# --------------------------------------------------------------------------- strings and keys


INVALID_UTF8 = {
    "0xff": b"\xff\xfe",
    "lone-continuation": b"\x80",
    "overlong-slash": b"\xc0\xaf",
    "surrogate": b"\xed\xa0\x80",
    "truncated-sequence": b"\xe2\x82",
}


@pytest.mark.parametrize("raw", INVALID_UTF8.values(), ids=INVALID_UTF8.keys())
def test_invalid_utf8_in_a_string_value(raw: bytes) -> None:
    placeholder = "P" * len(raw)
    data = pack(request_dict(input=[{"role": "user", "content": placeholder}]))
    data = data.replace(placeholder.encode(), raw)
    decode_error(data, code="malformed", words=("invalid utf-8",))


@pytest.mark.parametrize("raw", INVALID_UTF8.values(), ids=INVALID_UTF8.keys())
def test_invalid_utf8_in_a_map_key(raw: bytes) -> None:
    placeholder = "Q" * len(raw)
    data = pack(request_dict(metadata={placeholder: 1}))
    data = data.replace(placeholder.encode(), raw)
    decode_error(data, code="malformed", words=("invalid utf-8",))


NON_STRING_KEYS: dict[str, Any] = {
    "int": 1,
    "negative-int": -7,
    "nil": None,
    "bytes": b"key",
    "float": 1.5,
    "bool": True,
}


@pytest.mark.parametrize("key", NON_STRING_KEYS.values(), ids=NON_STRING_KEYS.keys())
def test_non_string_map_key_in_metadata(key: Any) -> None:
    data = pack(request_dict(metadata={key: 1}))
    decode_error(data, code="malformed", words=("map key",))


@pytest.mark.parametrize("key", NON_STRING_KEYS.values(), ids=NON_STRING_KEYS.keys())
def test_non_string_map_key_at_top_level(key: Any) -> None:
    data = pack({**request_dict(), key: 1})
    decode_error(data, code="malformed", words=("map key",))


def test_bytes_key_of_a_known_field_is_rejected() -> None:
    fields = request_dict()
    data = pack({key.encode(): value for key, value in fields.items()})
    decode_error(data, code="malformed", words=("map key",))


@pytest.mark.parametrize(
    "changes",
    [
        {"turn_id": b"T1"},
        {"metadata": {"k": b"\x00\xff"}},
        {"metadata": {"k": [1, b"x"]}},
        {"input": [{"role": "user", "content": b"hi"}]},
    ],
    ids=["id", "metadata-value", "metadata-list-item", "content"],
)
def test_binary_data_is_rejected(changes: dict[str, Any]) -> None:
    """``bin`` must not slip through lax str/Any fields (``encode`` could not re-encode it)."""
    decode_error(pack(request_dict(**changes)), code="malformed", words=("binary",))


def test_top_level_binary_is_rejected() -> None:
    decode_error(pack(b"\x81\xa1a\x01"), code="malformed", words=("binary",))


# --------------------------------------------------------------------------- ext types


EXTS: dict[str, bytes] = {
    "ext-type-5": pack(msgpack.ExtType(5, b"abc")),
    "timestamp": pack(msgpack.Timestamp(1, 0)),
    "fixext1": b"\xd4\x01\x00",
    "fixext16": b"\xd8\x01" + b"\x00" * 16,
    "ext8-empty": b"\xc7\x00\x01",
}


@pytest.mark.parametrize("ext", EXTS.values(), ids=EXTS.keys())
def test_ext_types_are_rejected(ext: bytes) -> None:
    decode_error(ext, code="malformed", words=("ext",))
    in_metadata = b"\x81\xa8metadata\x81\xa1k" + ext
    decode_error(in_metadata, code="malformed", words=("ext",))


def test_ext_inside_a_valid_request_is_rejected() -> None:
    data = pack(request_dict(metadata={"when": msgpack.Timestamp(1_700_000_000, 0)}))
    decode_error(data, code="malformed", words=("ext",))


# --------------------------------------------------------------------------- other bytes


@pytest.mark.parametrize("data", [b"\xc1", b"\xc1\x00", b"\x81\xc1\x00"], ids=["c1", "c1+", "key"])
def test_reserved_byte(data: bytes) -> None:
    decode_error(data, code="malformed", words=("msgpack",))


def test_fuzzed_mutations_raise_only_decode_error() -> None:
    """Bit flips, cuts and splices of a valid encoding either decode or raise DecodeError."""
    model = TurnRequest.model_validate(
        request_dict(metadata={"a": [1, 2.5, None, True, {"b": "c"}]}, deadline=12.5)
    )
    data = encode(model)
    rng = random.Random(20240601)
    for _ in range(3000):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            position = rng.randrange(len(mutated))
            choice = rng.random()
            if choice < 0.5:
                mutated[position] ^= 1 << rng.randrange(8)
            elif choice < 0.8:
                mutated[position] = rng.randrange(256)
            else:
                mutated[position:position] = rng.randbytes(rng.randint(1, 6))
        outcome = _outcome(bytes(mutated))
        if isinstance(outcome, DecodeError):
            assert outcome.code in {"malformed", "schema"}
            assert outcome.reason
        else:
            assert decode(encode(outcome), TurnRequest) == outcome, "a decoded message re-encodes"


def test_random_bytes_raise_only_decode_error() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        outcome = _outcome(rng.randbytes(rng.randint(1, 40)))
        assert isinstance(outcome, DecodeError)
        assert outcome.code in {"malformed", "schema"}


# --------------------------------------------------------------------------- schema errors


@pytest.mark.parametrize("value", [[1, 2], [], 1, -1, 1.5, "text", None, True], ids=repr)
def test_top_level_non_map(value: Any) -> None:
    error = decode_error(pack(value), code="schema", words=("expected a map", "TurnRequest"))
    assert type(value).__name__ in error.reason


@pytest.mark.parametrize("missing", ["turn_id", "session_id", "agent", "input"])
def test_missing_field(missing: str) -> None:
    data = request_dict()
    del data[missing]
    decode_error(pack(data), code="schema", words=(missing, "required"))


def test_unknown_extra_field() -> None:
    decode_error(pack(request_dict(surprise=1)), code="schema", words=("surprise", "extra"))


def test_unknown_extra_field_in_a_nested_contract() -> None:
    data = request_dict(input=[{"role": "user", "content": "hi", "surprise": 1}])
    decode_error(pack(data), code="schema", words=("surprise", "extra"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("turn_id", 5),
        ("session_id", ["S1"]),
        ("agent", None),
        ("input", "hi"),
        ("input", []),
        ("persist", "sometimes"),
        ("metadata", [1, 2]),
        ("limits", {"max_tool_iterations": "many"}),
        ("limits", {"max_tool_iterations": 501}),
        ("deadline", "tomorrow"),
        ("reply_to", "no spaces allowed"),
    ],
)
def test_wrong_types(field: str, value: Any) -> None:
    decode_error(pack(request_dict(**{field: value})), code="schema", words=(field,))


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_wrong_schema_version(version: Any) -> None:
    decode_error(
        pack(request_dict(schema_version=version)), code="schema", words=("schema_version",)
    )


def test_schema_error_reason_is_bounded() -> None:
    data = {f"extra_{index}": index for index in range(500)}
    error = decode_error(pack(data), code="schema", words=("and", "more"))
    assert len(error.reason) <= 1000


def test_a_valid_message_for_the_wrong_contract() -> None:
    decode_error(pack(request_dict()), TurnResult, code="schema", words=("TurnResult",))


# --------------------------------------------------------------------------- ids


BAD_IDS = {
    "dot": "a.b",
    "star": "a*",
    "hash": "a#b",
    "open-brace": "{a",
    "close-brace": "a}",
    "newline": "a\nb",
    "trailing-newline": "ab\n",
    "carriage-return": "a\rb",
    "space": "a b",
    "tab": "a\tb",
    "colon": "a:b",
    "slash": "a/b",
    "empty": "",
    "leading-underscore": "_a",
    "leading-dash": "-a",
    "non-ascii": "café",
    "nul": "a\x00b",
    "10kb": "x" * 10_240,
    "129-chars": "x" * 129,
}


@pytest.mark.parametrize("field", ["turn_id", "session_id", "agent"])
@pytest.mark.parametrize("bad", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_unsafe_ids_are_rejected(field: str, bad: str) -> None:
    error = decode_error(
        pack(request_dict(**{field: bad})), code="schema", words=(field, "pattern")
    )
    if len(bad) > 1000:
        assert bad not in error.reason, "the reason must not echo a huge id"


@pytest.mark.parametrize("good", ["a", "A", "0", "a-b_c", "T-2024_01", "x" * 128])
def test_safe_ids_are_accepted(good: str) -> None:
    data = pack(request_dict(turn_id=good, session_id=good, agent=good))
    request = decode(data, TurnRequest)
    assert (request.turn_id, request.session_id, request.agent) == (good, good, good)


@pytest.mark.parametrize("field", ["turn_id", "session_id", "agent"])
@pytest.mark.parametrize("bad", ["a.b", "a*", "a#", "{a}", "a\n", "a b", ""])
def test_unsafe_ids_in_events_are_rejected(field: str, bad: str) -> None:
    event = make_event(
        "turn.accepted",
        TurnAccepted(persist=True, input_messages=1),
        agent="support",
        time=1.0,
        turn_id="T1",
        session_id="S1",
    )
    data = pack({**event.model_dump(mode="json"), field: bad})
    decode_error(data, Event, code="schema", words=(field,))


def test_unsafe_parent_session_id_is_rejected() -> None:
    data = pack(request_dict(parent_session_id="a.b"))
    decode_error(data, code="schema", words=("parent_session_id",))


@pytest.mark.parametrize("bad", ["a.b", "a b", "", "x" * 65, "a*"])
def test_unsafe_tool_names_are_rejected(bad: str) -> None:
    decode_error(pack({"name": bad}), ToolDefinition, code="schema", words=("name",))


# --------------------------------------------------------------------------- size


def test_message_over_max_message_bytes() -> None:
    data = pack(request_dict(input=[{"role": "user", "content": "x" * MAX_MESSAGE_BYTES}]))
    assert len(data) > MAX_MESSAGE_BYTES
    error = decode_error(data, code="oversize", words=("limit", str(MAX_MESSAGE_BYTES)))
    assert str(len(data)) in error.reason


def test_oversize_is_checked_before_parsing() -> None:
    data = b"\xc1" * (MAX_MESSAGE_BYTES + 1)  # not even msgpack
    decode_error(data, code="oversize", words=("limit",))


def test_message_over_a_smaller_max_bytes() -> None:
    data = pack(request_dict())
    decode_error(data, code="oversize", words=("limit",), max_bytes=len(data) - 1)
    decode_error(data, code="oversize", words=("limit",), max_bytes=16)
    assert decode(data, TurnRequest, max_bytes=len(data)).turn_id == "T1"


def test_max_bytes_applies_to_decode_obj() -> None:
    with pytest.raises(DecodeError) as info:
        decode_obj(pack([1, 2, 3]), max_bytes=2)
    assert info.value.code == "oversize"


# --------------------------------------------------------------------------- round-trips


USAGE = Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15)

REQUEST = TurnRequest(
    turn_id="T1",
    session_id="S1",
    agent="support",
    input=(InputMessage(content="Where is my order?"), InputMessage(content="It is #42.")),
    limits=LimitOverrides(max_tool_iterations=3, empty_streak_after=0),
    persist=False,
    parent_session_id="P1",
    metadata={"tenant": "acme", "tags": ["a", "b"], "nested": {"n": 1, "f": 0.5, "z": None}},
    reply_to="amq.rabbitmq.reply-to",
    deadline=1_700_000_100.25,
)

RESULT_STOP = TurnResult(
    turn_id="T1",
    session_id="S1",
    agent="support",
    content="Your order ships tomorrow.",
    finish_reason="stop",
    usage=USAGE,
    steps=2,
    duration_s=1.5,
    completed_at=1_700_000_002.0,
)

RESULT_ERROR = TurnResult(
    turn_id="T2",
    session_id="S1",
    agent="support",
    content=None,
    finish_reason="error",
    error=TurnError(code="model_unavailable", message="the model endpoint did not answer"),
    stopped_by="budget-hook",
    steps=0,
    duration_s=0.0,
    completed_at=1_700_000_003.0,
)

TOOL_DEFINITION = ToolDefinition(
    name="lookup_order",
    description="Find an order by number.",
    parameters={
        "type": "object",
        "properties": {"number": {"type": "integer"}},
        "required": ["number"],
    },
    timeout_s=5.0,
    idempotent=False,
)

TOOL_EXECUTION = ToolExecution(
    call_id="call_1",
    name="lookup_order",
    arguments={"number": 42},
    outcome="ok",
    value={"items": [{"id": 42, "status": "shipped"}]},
    content='{"items": [{"id": 42, "status": "shipped"}]}',
    started_at=1_700_000_000.5,
    completed_at=1_700_000_000.75,
)

ASSISTANT_CALL = ChatMessage(
    role="assistant",
    content=None,
    tool_calls=(ToolCall(id="call_1", name="lookup_order", arguments='{"number": 42}'),),
)

EVENT_DATA: dict[str, EventData] = {
    "turn.accepted": TurnAccepted(persist=True, input_messages=2),
    "turn.started": TurnStarted(history_len=4, max_tool_iterations=7),
    "step.completed": StepCompleted(
        step_type="tool_execution",
        finish_reason="tool_calls",
        tool_calls=1,
        usage=USAGE,
        duration_s=0.5,
        model_duration_s=0.25,
    ),
    "tool.invoking": ToolInvoking(tool="lookup_order", call_id="call_1", attempt=2),
    "tool.invoked": ToolInvoked(
        tool="lookup_order",
        call_id="call_1",
        outcome="error",
        duration_s=0.125,
        truncated=True,
        error="order service timed out",
    ),
    "turn.completed": TurnFinished(result=RESULT_STOP),
    "turn.failed": TurnFinished(result=RESULT_ERROR),
    "turn.cancelled": TurnFinished(
        result=RESULT_ERROR.model_copy(
            update={"finish_reason": "cancelled", "error": None, "stopped_by": "user left"}
        )
    ),
    "turn.rejected": TurnRejected(reason="agent 'nobody' is not configured", code="unknown_agent"),
    "approval.requested": ApprovalRequested(
        call_id="call_1", tool="refund", arguments='{"amount": 20}', until=1_700_003_600.0
    ),
    "approval.decided": ApprovalDecided(
        call_id="call_1", decision="reject", by="maria", message="over the limit"
    ),
    "budget.exhausted": BudgetExhausted(
        budget="turn.max_tool_calls", limit=3, used=3, final_call=True
    ),
    **LATER_EVENT_DATA,
}


def test_event_data_covers_every_event_type() -> None:
    assert set(EVENT_DATA) == set(EVENT_TYPES)


def agent_state() -> AgentState:
    execution = ExecutionState(
        turn_id="T1",
        request=REQUEST,
        limits=LimitOverrides(max_tool_iterations=3).apply(LoopLimits()),
        status="in_progress",
        history_start=4,
        message_count=3,
        steps=(
            StepExecution(
                step=AgentStep(
                    index=0,
                    input_count=5,
                    output_messages=(
                        ASSISTANT_CALL,
                        ChatMessage.tool("call_1", TOOL_EXECUTION.content),
                    ),
                    response=ModelResponse(
                        message=ASSISTANT_CALL,
                        finish_reason="tool_calls",
                        usage=USAGE,
                        model="gpt-test",
                        response_id="resp-1",
                        duration_s=0.25,
                    ),
                    tool_executions=(TOOL_EXECUTION,),
                ),
                started_at=1_700_000_000.0,
                completed_at=1_700_000_001.0,
            ),
        ),
        pending=PendingStep(
            index=1,
            started_at=1_700_000_001.0,
            input_count=7,
            response=ModelResponse(message=ASSISTANT_CALL),
            results=(TOOL_EXECUTION,),
            offered=("lookup", "search"),
        ),
        stop_signal=StopSignal(source="budget-hook", reason="spent"),
        usage=USAGE,
        empty_streak=1,
        last_content="thinking",
        started_at=1_700_000_000.0,
        updated_at=1_700_000_001.0,
        result=RESULT_STOP,
    )
    return AgentState(
        session_id="S1",
        parent_session_id="P1",
        agent="support",
        context=SessionContext(
            system_prompt="You are helpful.",
            metadata={"tenant": "acme"},
            response_format={"type": "json_object"},
            kv={"cart": [1, 2], "vip": True},
        ),
        llm=LLMOverrides(model="gpt-test", temperature=0.2, max_tokens=512),
        history_len=4,
        execution_count=1,
        version=9,
        created_at=1_699_999_000.0,
        updated_at=1_700_000_001.0,
        execution=execution,
    )


ROUND_TRIPS: dict[str, BaseModel] = {
    "TurnRequest": REQUEST,
    "TurnRequest-minimal": TurnRequest.model_validate(request_dict()),
    "TurnResult-stop": RESULT_STOP,
    "TurnResult-error": RESULT_ERROR,
    "ToolDefinition": TOOL_DEFINITION,
    "ToolDefinition-defaults": ToolDefinition(name="noop"),
    "ToolCallRequest": ToolCallRequest(
        call_id="call_1",
        tool="lookup_order",
        arguments={"number": 42, "verbose": False},
        context=ToolContext(
            session_id="S1",
            turn_id="T1",
            agent="support",
            metadata={"tenant": "acme"},
            deadline=1_700_000_030.0,
            idempotency_key="T1:call_1",
        ),
    ),
    "ToolCallReply-ok": ToolCallReply(
        call_id="call_1",
        status="ok",
        value={"items": [{"id": 42}], "count": 1, "ratio": 0.5},
        state_updates={"last_order": 42},
    ),
    "ToolCallReply-error": ToolCallReply(call_id="call_1", status="error", error="not found"),
    "ToolCallReply-unknown": ToolCallReply(call_id="call_1", status="unknown"),
    "ToolAnnouncement": ToolAnnouncement(
        service="orders",
        instance_id="orders-7f9c",
        tools=(TOOL_DEFINITION, ToolDefinition(name="cancel_order")),
        announced_at=1_700_000_000.0,
        expires_at=1_700_000_030.0,
    ),
    "AgentState": agent_state(),
    "AgentState-between-turns": AgentState(
        session_id="S1", agent="support", created_at=1.0, updated_at=2.0
    ),
}


def _round_trip(model: BaseModel) -> None:
    data = encode(model)
    decoded = decode(data, type(model))
    assert decoded == model
    assert type(decoded) is type(model)
    assert encode(decoded) == data, "re-encoding must give the same bytes"


@pytest.mark.parametrize("model", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_round_trip(model: BaseModel) -> None:
    _round_trip(model)


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_event_round_trip(event_type: Any) -> None:
    data = EVENT_DATA[event_type]
    event = make_event(
        event_type,
        data,
        agent="support",
        time=1_700_000_000.125,
        turn_id="T1",
        session_id="S1",
        step=3,
        call_id="call_1",
    )
    _round_trip(event)
    decoded = decode(encode(event), Event)
    assert type(decoded.data) is type(data), "the event data must decode to its own class"


def test_event_round_trip_without_a_turn() -> None:
    event = make_event(
        "turn.rejected",
        TurnRejected(reason="could not decode the request", code="malformed"),
        agent="_unknown",
        time=0.0,
    )
    _round_trip(event)


def test_encoding_is_plain_msgpack() -> None:
    """The wire form is plain msgpack maps of JSON data: no bin, no ext."""
    data = encode(agent_state())
    plain = msgpack.unpackb(data, raw=False, max_bin_len=0, max_ext_len=0)
    assert plain["session_id"] == "S1"
    assert plain["execution"]["request"]["input"][0]["content"] == "Where is my order?"


def test_state_at_rest_is_json_without_defaults_and_reads_back_whole() -> None:
    state = agent_state()
    stored = encode_stored(state)
    data = json.loads(stored)
    assert data["schema_version"] == 1, "the version is written, default or not"
    assert "truncated" not in data["execution"]["pending"]["results"][0], "defaults are not"
    assert data["execution"]["steps"][0]["step"]["response"]["usage"] == USAGE.model_dump()
    assert read_stored(stored, AgentState) == state
    assert len(stored) < len(encode(state))


def test_state_written_as_msgpack_by_an_earlier_version_still_reads() -> None:
    state = agent_state()
    assert read_stored(encode(state), AgentState) == state


def test_a_stored_state_that_does_not_validate_is_a_decode_error() -> None:
    with pytest.raises(DecodeError) as caught:
        read_stored(b'{"session_id": "S1"}', AgentState)
    assert caught.value.code == "schema"


def test_a_json_body_is_said_to_be_json_not_msgpack() -> None:
    with pytest.raises(DecodeError, match=r"^not msgpack: the body is JSON"):
        decode(json.dumps({"turn_id": "t1", "agent": "a"}).encode(), TurnRequest)


def test_a_too_long_message_is_the_only_problem_named() -> None:
    body = encode_obj(
        {"turn_id": "t", "session_id": "s", "agent": "a", "input": [{"content": "x" * 1_000_001}]}
    )
    with pytest.raises(DecodeError) as caught:
        decode(body, TurnRequest)
    assert caught.value.reason == (
        "invalid TurnRequest: input.0.content: String should have at most 1000000 characters"
    )
