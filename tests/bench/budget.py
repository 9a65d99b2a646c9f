"""The performance budget's targets (DESIGN.md, "Performance budget") and how a run's figures
are judged against them.

A target is judged only on medians of at least ``MIN_ROUNDS`` alternated rounds (the order
reversed every round): with fewer, the verdict says "not judged (n rounds)" instead of holds
or missed, because one round on these shared machines can be off by a third. A ratio target
takes the ratio of the two systems' medians, not the median of per-round ratios.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

MIN_ROUNDS = 3

STEP_VS_PROTOCOL = 1.25
"""loopwire's worker CPU per step, at most this times the protocol floor's (32 and 256 sessions)."""
KB_PER_TURN = 50.0
"""Memory per turn in flight, at most this many KB, at ``KB_PER_TURN_AT`` turns in flight."""
KB_PER_TURN_AT = 2000
TOOL_VS_FLOOR = 1.5
"""The SDK tool service's CPU per call, at most this times the tool protocol floor's."""
LATE_VS_EARLY = 1.15
"""Steps 46-50 of a 50-step turn cost at most this times steps 1-5 of the same turns, in
worker CPU and in bytes written to Redis (loopwire's)."""
LATE_VS_EARLY_STEPS = 50
"""The turn length that target is set at."""


@dataclass(frozen=True)
class Judged:
    """One target next to the figure it judges."""

    target: str
    """What is held to what, e.g. "loopwire <= 1.25x protocol floor"."""
    limit: float
    value: float
    """The figure (a ratio of medians, or a median); NaN when not measured."""
    rounds: int
    """Rounds behind the figure (the fewer of the two systems', for a ratio)."""
    verdict: str
    """"holds", "missed", "not judged (...)" or "not measured"."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def cell(self) -> str:
        """The verdict as a table cell: "1.31 > 1.25: missed"."""
        if self.value != self.value:
            return self.verdict
        sign = "<=" if self.value <= self.limit else ">"
        return f"{self.value:.2f} {sign} {self.limit:g}: {self.verdict}"


def verdict(value: float, limit: float, rounds: int, *, unmet: str = "") -> str:
    """Whether ``value`` (from ``rounds`` alternated rounds) holds within ``limit``;
    ``unmet`` names a condition of the target the run did not meet (e.g. a smaller load)."""
    if unmet:
        return f"not judged ({unmet})"
    if value != value or rounds == 0:
        return "not measured"
    if rounds < MIN_ROUNDS:
        return f"not judged ({rounds} round{'' if rounds == 1 else 's'})"
    return "holds" if value <= limit else "missed"


def ratio_target(
    target: str,
    system: Sequence[float],
    reference: Sequence[float],
    limit: float,
    *,
    unmet: str = "",
) -> Judged:
    """``median(system) / median(reference) <= limit``, over per-round figures; ``unmet`` as
    for ``verdict``."""
    mine, theirs = _finite(system), _finite(reference)
    rounds = min(len(mine), len(theirs))
    value = float("nan")
    if rounds and statistics.median(theirs) > 0:
        value = statistics.median(mine) / statistics.median(theirs)
    return Judged(target, limit, value, rounds, verdict(value, limit, rounds, unmet=unmet))


def ceiling_target(
    target: str, figures: Sequence[float], limit: float, *, unmet: str = ""
) -> Judged:
    """``median(figures) <= limit``, over per-round figures."""
    found = _finite(figures)
    value = statistics.median(found) if found else float("nan")
    return Judged(target, limit, value, len(found), verdict(value, limit, len(found), unmet=unmet))


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if v == v and v not in (float("inf"), float("-inf"))]
