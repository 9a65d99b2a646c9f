"""A context that fits: a profile's ``context`` budget for the compiled request.

With ``max_tokens`` set, each model call is sent at most that many (estimated) tokens:

- ``window`` drops the oldest exchanges whole: the history is cut only where a user message
  begins, so an assistant's tool calls never lose their results; the system prompt, this
  turn's messages and the last ``keep_last`` messages are never dropped.
- ``summarize`` cuts the same way, and sends in place of what it dropped one message with a
  summary of it, made by one model call (the agent's model, or ``summary_model``) and saved
  in the session state at once, so that it is made once: a later cut folds the summary before
  into the next one. The summary counts in the budget: when a new one leaves too little room
  for what follows it, what the cut then passes is folded in too (``worker.loop.fitting``).
  The summary call's usage counts in the turn's usage and budgets.

The full history stays in Redis as it is; only what is sent is cut. The size is estimated
without a tokenizer: ``(characters / 4 + 4)`` per message, scaled by the ratio between the
last model answer's ``prompt_tokens`` and the estimate of what it was sent (kept in the
session state). A ``persist: false`` turn changes neither the summary nor the ratio: it sends
the session's summary but makes none (its cut past it drops, as ``window``). A model error
that says the context is too long makes the step try once more with half the estimated size
(``worker.loop.completion``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from contracts.base import Contract
from contracts.messages import ChatMessage

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
TOO_LONG = ("context length", "context_length", "maximum context", "too long", "too many tokens")
"""What a model error says when the request did not fit the model's context."""

SUMMARY_PROMPT = (
    "Summarize the conversation below for yourself, to go on with it later: the user's goals, "
    "the facts and decisions so far, what tools returned that still matters, and what is still "
    "open. Be brief; keep names, numbers and ids exactly."
)


class ContextBudget(Contract):
    max_tokens: int | None = Field(
        default=None, ge=256, description="Estimated tokens a request may have (none: no limit)."
    )
    strategy: Literal["window", "summarize"] = "window"
    keep_last: int = Field(default=6, ge=0, le=1000, description="Messages always sent.")
    summary_model: str | None = Field(
        default=None, description="The model that writes summaries (default: the agent's)."
    )
    summary_prompt: str = Field(default=SUMMARY_PROMPT, max_length=4000)


NO_CONTEXT_BUDGET = ContextBudget()


def estimate(message: dict[str, Any]) -> int:
    """A stored message's size in (unscaled) tokens."""
    chars = len(message.get("content") or "")
    for call in message.get("tool_calls") or ():
        chars += len(call.get("name") or "") + len(call.get("arguments") or "")
    return chars // CHARS_PER_TOKEN + TOKENS_PER_MESSAGE


def too_long(error_message: str) -> bool:
    text = error_message.lower()
    return any(marker in text for marker in TOO_LONG)


@dataclass(frozen=True, slots=True)
class Cut:
    """Where the sent conversation starts (``start``: messages before it are dropped) and the
    estimated tokens of what is sent."""

    start: int
    tokens: int


def cut_point(
    raw: Sequence[dict[str, Any]], fixed: int, budget: int, keep_from: int, ratio: float
) -> Cut:
    """The earliest cut at which ``fixed`` tokens (the system prompt, a summary) and the
    messages from the cut on fit ``budget``; at most ``keep_from`` (what must be sent). A cut is
    only ever at a user message (or at ``keep_from`` when nothing else is possible)."""
    sizes = [estimate(m) for m in raw]
    total = sum(sizes)
    if (fixed + total) * ratio <= budget:
        return Cut(0, round((fixed + total) * ratio))
    kept = total
    best = 0
    for index in range(len(raw)):
        if index > keep_from:
            break
        if index > 0:
            kept -= sizes[index - 1]
        if raw[index].get("role") != "user" and index != keep_from:
            continue
        best = index
        if (fixed + kept) * ratio <= budget:
            break
    return Cut(best, round((fixed + sum(sizes[best:])) * ratio))


def protected_from(raw: Sequence[dict[str, Any]], turn_start: int, keep_last: int) -> int:
    """The first message that must be sent: this turn's first, or one of the last ``keep_last``
    (moved back to the user message it belongs to, so nothing is split)."""
    keep = min(turn_start, max(0, len(raw) - keep_last))
    while keep > 0 and raw[keep].get("role") != "user":
        keep -= 1
    return keep


def summary_message(text: str) -> ChatMessage:
    return ChatMessage(role="system", content=f"Summary of the earlier conversation:\n{text}")


def summary_request(previous: str | None, dropped: Sequence[ChatMessage]) -> list[ChatMessage]:
    """What the summary call is sent: the summary before (if any) and the messages it adds."""
    lines = []
    if previous:
        lines.append(f"(summary so far) {previous}")
    for message in dropped:
        text = message.content or ""
        if message.tool_calls:
            calls = ", ".join(f"{c.name}({c.arguments})" for c in message.tool_calls)
            text = f"{text} [calls {calls}]".strip()
        lines.append(f"{message.role}: {text}")
    return [ChatMessage(role="user", content="\n".join(lines))]
