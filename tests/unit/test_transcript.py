"""The model request's messages: the stored history goes to the wire shape without being
rebuilt as message objects, and reads the same either way."""

from __future__ import annotations

import msgpack

from contracts.codec import encode
from contracts.messages import ChatMessage, ToolCall
from worker.loop.transcript import StoredMessages, Transcript, to_wire, wire_messages

MESSAGES = [
    ChatMessage.user("what is 6*7? ünïcode ✓"),
    ChatMessage(
        role="assistant",
        content=None,
        tool_calls=(
            ToolCall(id="call_1", name="calculate", arguments='{"expression":"6*7"}'),
            ToolCall(id="call_2", name="lookup"),
        ),
    ),
    ChatMessage.tool("call_1", "42"),
    ChatMessage.tool("call_2", '{"error": "nope"}'),
    ChatMessage(role="assistant", content=""),
    ChatMessage(role="user", content="hi", name="alice"),
    ChatMessage(role="assistant", content="It is 42."),
]


def stored() -> StoredMessages:
    """As the store hands them over: each message encoded when saved, decoded to plain data."""
    return StoredMessages([msgpack.unpackb(encode(m), raw=False) for m in MESSAGES])


def test_stored_messages_reach_the_wire_shape_exactly_as_message_objects_do() -> None:
    assert stored().wire() == [to_wire(m) for m in MESSAGES]


def test_the_wire_shape_is_what_chat_completions_expects() -> None:
    wire = stored().wire()
    assert wire[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calculate", "arguments": '{"expression":"6*7"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": "{}"}},
        ],
    }
    assert wire[2] == {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    assert wire[5] == {"role": "user", "content": "hi", "name": "alice"}


def test_read_as_messages_they_equal_what_was_stored() -> None:
    history = stored()
    assert len(history) == len(MESSAGES)
    assert list(history) == MESSAGES
    assert history[2] == MESSAGES[2]
    assert list(history[1:3]) == MESSAGES[1:3]


def test_a_transcript_puts_the_system_prompt_first() -> None:
    system = ChatMessage.system("be brief")
    transcript = Transcript(system, stored())
    assert len(transcript) == len(MESSAGES) + 1
    assert transcript.wire() == [{"role": "system", "content": "be brief"}, *stored().wire()]
    assert list(transcript) == [system, *MESSAGES]
    assert wire_messages(transcript) == transcript.wire()


def test_a_transcript_over_plain_messages_and_without_a_prompt() -> None:
    transcript = Transcript(None, MESSAGES)
    assert len(transcript) == len(MESSAGES)
    assert transcript.wire() == [to_wire(m) for m in MESSAGES]
    assert wire_messages(list(transcript)) == transcript.wire()
