"""The benchmark judges the performance budget's targets only on enough rounds."""

from __future__ import annotations

import math

from tests.bench.budget import ceiling_target, ratio_target, verdict

NAN = float("nan")


def test_a_ratio_of_medians_within_the_limit_holds() -> None:
    judged = ratio_target("lw <= 1.25x protocol", [3.0, 3.5, 9.0], [3.0, 2.9, 2.5], 1.25)
    assert judged.value == 3.5 / 2.9
    assert judged.rounds == 3
    assert judged.verdict == "holds"
    assert judged.cell == "1.21 <= 1.25: holds"


def test_a_ratio_of_medians_over_the_limit_is_missed() -> None:
    judged = ratio_target("lw <= 1.25x protocol", [4.0, 4.0, 4.0, 4.0], [3.0] * 4, 1.25)
    assert judged.verdict == "missed"
    assert judged.cell == "1.33 > 1.25: missed"


def test_fewer_than_three_rounds_are_not_judged_either_way() -> None:
    over = ratio_target("t", [9.0], [1.0], 1.25)
    under = ratio_target("t", [1.0, 1.0], [1.0, 1.0], 1.25)
    assert over.verdict == "not judged (1 round)"
    assert under.verdict == "not judged (2 rounds)"
    assert over.value == 9.0  # the figure is still shown


def test_rounds_count_only_figures_both_systems_have() -> None:
    judged = ratio_target("t", [1.0, NAN, 1.0], [1.0, 1.0, 1.0], 1.25)
    assert judged.rounds == 2
    assert judged.verdict == "not judged (2 rounds)"


def test_nothing_measured_says_so() -> None:
    judged = ratio_target("t", [], [1.0, 1.0, 1.0], 1.25)
    assert math.isnan(judged.value)
    assert judged.verdict == "not measured"
    assert judged.cell == "not measured"
    assert ratio_target("t", [1.0] * 3, [0.0] * 3, 1.25).verdict == "not measured"


def test_a_ceiling_is_judged_on_the_median() -> None:
    assert ceiling_target("kb", [38.0, 61.0, 41.0], 50).verdict == "holds"
    assert ceiling_target("kb", [51.0, 61.0, 41.0], 50).verdict == "missed"


def test_a_condition_the_run_did_not_meet_comes_first() -> None:
    judged = ceiling_target("kb", [38.0, 39.0, 40.0], 50, unmet="300 turns in flight, not 2,000")
    assert judged.verdict == "not judged (300 turns in flight, not 2,000)"
    assert (
        verdict(NAN, 1.25, 0, unmet="256 sessions not run") == "not judged (256 sessions not run)"
    )


def test_a_judged_target_goes_into_the_results_as_plain_data() -> None:
    judged = ceiling_target("kb", [40.0, 41.0, 42.0], 50)
    assert judged.as_dict() == {
        "target": "kb",
        "limit": 50,
        "value": 41.0,
        "rounds": 3,
        "verdict": "holds",
    }
