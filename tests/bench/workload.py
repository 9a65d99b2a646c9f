"""The benchmark's workload, shared by the floor and loopwire: a 40-message history (~20 KB),
one tool call per step, a fixed number of steps per turn.

Every turn's input message carries ``bench-turn <turn_id>`` so that the bench model server can
tell turns apart and time what happens between one model call of a turn and the next.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

HISTORY_MESSAGES = 40
STEPS_PER_TURN = 5
"""Every step calls the model and then one tool; the iteration cap ends the turn."""
TOOL = "calculate"
TOOL_ARGUMENTS = {"expression": "6*7"}
AGENT = "bench"
SUB_AGENT = "bench_helper"
"""The agent the ``subagent`` scenario's agent calls in every step instead of the tool."""
SYSTEM_PROMPT = "You are a careful assistant. Use the calculator for arithmetic."
TURN_MARK = "bench-turn "
_TURN_RE = re.compile(r"bench-turn ([A-Za-z0-9_-]+)")

AMQP_URL = os.environ.get("LOOPWIRE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/lw_bench")
REDIS_URL = os.environ.get("LOOPWIRE_REDIS_URL", "redis://127.0.0.1:6379/3")
REDIS_CLUSTER = os.environ.get("LOOPWIRE_REDIS_CLUSTER", "").strip().lower() in ("1", "true", "yes")
"""A Redis Cluster (as the processes read it; a ``redis+cluster://`` URL says so too)."""
KEY_TTL_S = 900
"""How long the bench's Redis keys live if a run dies before its cleanup."""

_SENTENCE = (
    "the order was shipped on monday and should arrive within five business days unless "
    "the carrier reports a delay at the regional hub in which case the customer receives "
    "an automatic notice with a new estimate and a link to track the parcel online"
)
_WORDS = _SENTENCE.split(" ")


def _text(seed: int, chars: int) -> str:
    words: list[str] = []
    size = 0
    i = seed
    while size < chars:
        word = _WORDS[i % len(_WORDS)]
        words.append(word)
        size += len(word) + 1
        i = i * 7 + 3
    return " ".join(words)[:chars]


def history() -> list[dict[str, Any]]:
    """40 messages in the OpenAI chat shape: 10 rounds of user, tool call, tool result, answer."""
    messages: list[dict[str, Any]] = []
    for r in range(HISTORY_MESSAGES // 4):
        call_id = f"call_hist_{r}"
        messages.append({"role": "user", "content": _text(r * 4 + 1, 220)})
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": TOOL,
                            "arguments": json.dumps({"expression": f"{r}*17+4"}),
                        },
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(r * 4 + 2, 850)})
        messages.append({"role": "assistant", "content": _text(r * 4 + 3, 620)})
    return messages


def tool_definition() -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": TOOL,
            "description": "Evaluate an arithmetic expression exactly.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }


def turn_input(turn_id: str) -> str:
    return f"{TURN_MARK}{turn_id}: what is 6*7, and then again, a few times?"


def turn_of(body: dict[str, Any]) -> str | None:
    """The turn a chat-completions request belongs to (from its last user message)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            found = _TURN_RE.search(str(message.get("content") or ""))
            return found.group(1) if found else None
    return None


def step_of(body: dict[str, Any]) -> int | None:
    """Which model call of its turn a chat-completions request is (1 for the first): every
    completed step adds two messages after the turn's input (the assistant's tool call and the
    tool's result)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if isinstance(message, dict) and message.get("role") == "user":
            return (len(messages) - 1 - i) // 2 + 1
    return None


@dataclass(frozen=True)
class Load:
    """One load level: ``sessions`` turns in flight at all times, each on a fresh session with
    the 40-message history, each running ``steps`` steps."""

    sessions: int
    steps: int = STEPS_PER_TURN
    warmup_s: float = 2.0
    window_s: float = 10.0
