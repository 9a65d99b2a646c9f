"""The ``long`` benchmark scenario's arithmetic: which model calls hold the turns, what a window
adds up (without the time held at barriers), the per-process Redis traffic read from ``ss``,
the step a model request is, and the lookup tool's result sizes."""

from __future__ import annotations

import orjson
import pytest

from tests.bench.long import END, Batch, Sample, barriers, parse_ss, runnable
from tests.bench.lookup import QUERY, lookup_result
from tests.bench.workload import step_of

SS = """\
ESTAB 0 0 127.0.0.1:51000 127.0.0.1:6379 users:(("python",pid=101,fd=7))
\t cubic wscale:7,7 rto:204 bytes_sent:1000 bytes_acked:1001 bytes_received:5000 segs_out:9
ESTAB 0 0 127.0.0.1:51002 127.0.0.1:6379 users:(("python",pid=101,fd=9))
\t cubic wscale:7,7 rto:204 bytes_sent:24 bytes_acked:25 bytes_received:7 segs_out:4
ESTAB 0 0 127.0.0.1:51004 127.0.0.1:6379 users:(("python",pid=202,fd=3))
\t cubic wscale:7,7 rto:204 bytes_received:11 segs_out:1
"""


def test_ss_traffic_is_summed_per_process() -> None:
    assert parse_ss(SS) == {101: (1024, 5007), 202: (0, 11)}
    assert parse_ss("") == {}


def test_the_turns_are_held_at_the_windows_ends_and_where_the_state_is_read() -> None:
    assert barriers(50) == [1, 5, 6, 46, 50]
    assert barriers(10) == [1, 5, 6, 10]
    assert barriers(12) == [1, 5, 6, 8, 12]


def test_turns_too_short_for_two_windows_are_not_run() -> None:
    assert runnable(9)
    assert runnable(10) == ""
    assert runnable(50) == ""


def _sample(at: float, cpu: float, sent: int = 0) -> Sample:
    return Sample(
        at=at,
        cpu={"w": cpu, "t": cpu / 10},
        sys_cpu={"w": 0.0, "t": 0.0},
        sent={"w": sent, "t": 0},
        received={"w": 2 * sent, "t": 0},
        server=(sent, 2 * sent),
    )


def test_a_window_leaves_out_the_time_held_at_its_barriers() -> None:
    # 2 turns of 12 steps; every hold (arrived -> released) adds 1 s of CPU, which no window
    # may count; between barriers the workers spend 0.1 s and write 1,000 bytes a stretch
    arrived, released = {}, {}
    cpu, sent, at = 0.0, 0, 0.0
    for k in [*barriers(12), END]:
        cpu, sent, at = cpu + 0.1, sent + 1000, at + 1
        arrived[k] = _sample(at, cpu, sent)
        if k != END:
            cpu, at = cpu + 1.0, at + 5
            released[k] = _sample(at, cpu, sent)
    batch = Batch("w", 12, 2, arrived, released, ["w"], ["t"], {5: 1.0, 12: 2.0}, {})
    early, late = batch.early(), batch.late()
    # steps 1-5: two stretches (1 -> 5, 5 -> 6) of 0.1 s CPU each, over 2 x 5 steps
    assert early["worker_cpu_ms_per_step"] == pytest.approx(1000 * 0.2 / 10)
    assert early["written_bytes_per_step"] == pytest.approx(2000 / 10)
    assert early["read_bytes_per_step"] == pytest.approx(4000 / 10)
    assert early["seconds"] == pytest.approx(2.0)
    # steps 8-12: 8 -> 12, then 12 -> the end
    assert late["worker_cpu_ms_per_step"] == pytest.approx(1000 * 0.2 / 10)
    assert late["tool_cpu_ms_per_step"] == pytest.approx(1000 * 0.02 / 10)
    assert late["server_in_bytes_per_step"] == pytest.approx(2000 / 10)


def test_a_request_says_which_model_call_of_its_turn_it_is() -> None:
    history = [{"role": "user", "content": "old"}, {"role": "assistant", "content": "a"}]
    turn = [{"role": "system", "content": "s"}, *history, {"role": "user", "content": "now"}]
    step = [{"role": "assistant", "content": None}, {"role": "tool", "content": "r"}]
    assert step_of({"messages": turn}) == 1
    assert step_of({"messages": [*turn, *step]}) == 2
    assert step_of({"messages": [*turn, *step * 49]}) == 50
    assert step_of({"messages": [{"role": "system", "content": "s"}]}) is None
    assert step_of({}) is None


@pytest.mark.parametrize("size", [4096, 16384])
def test_a_lookup_result_has_the_size_asked_for(size: int) -> None:
    result = lookup_result(QUERY, size)
    assert len(orjson.dumps(result)) == size
    assert result["items"]
    assert result == lookup_result(QUERY, size)
