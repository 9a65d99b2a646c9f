"""The loop's guards on tool results: truncation and the empty-streak hint.

Truncation is crude on purpose: the first ``limit`` characters and a visible
marker saying how much was cut.

The empty-streak guard judges each tool result in call order. A result whose
value is a JSON object carrying any of ``result_keys`` is a search: it is empty
when every such key it carries is empty. An error (or a blocked or unknown
call) counts as nothing found. A result with none of the keys says nothing
about searching: it neither counts nor resets the streak. Once the streak
reaches ``empty_streak_after`` the hint is appended to the tool's own text
(never replacing it), with ``:count`` replaced by the streak; 0 turns it off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from contracts.state import ToolExecution
from contracts.turns import LoopLimits

Verdict = Literal["empty", "found", "neutral"]
TRUNCATION_MARKER = "… [truncated {cut} of {total} characters]"


def truncate(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to ``limit`` characters plus a marker; the flag says whether it was cut."""
    if len(text) <= limit:
        return text, False
    return text[:limit] + TRUNCATION_MARKER.format(cut=len(text) - limit, total=len(text)), True


def judge(execution: ToolExecution, result_keys: Sequence[str]) -> Verdict:
    if execution.outcome != "ok":
        return "empty"
    value = execution.value
    if not isinstance(value, dict):
        return "neutral"
    present = [key for key in result_keys if key in value]
    if not present:
        return "neutral"
    return "empty" if all(_is_empty(value[key]) for key in present) else "found"


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, list | dict | str | tuple) and len(value) == 0)


def apply_empty_streak(
    executions: Sequence[ToolExecution], streak: int, limits: LoopLimits
) -> tuple[list[ToolExecution], int, int]:
    """Judge ``executions`` in order; returns them (hint appended where due), the new streak,
    and how many hints were appended."""
    out: list[ToolExecution] = []
    hints = 0
    threshold = limits.empty_streak_after
    for execution in executions:
        verdict = judge(execution, limits.result_keys)
        if verdict == "empty":
            streak += 1
        elif verdict == "found":
            streak = 0
        if threshold > 0 and verdict == "empty" and streak >= threshold:
            hint = limits.empty_streak_hint.replace(":count", str(streak))
            execution = execution.model_copy(update={"content": f"{execution.content}\n\n{hint}"})
            hints += 1
        out.append(execution)
    return out, streak, hints
