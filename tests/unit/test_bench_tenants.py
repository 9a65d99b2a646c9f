"""The ``tenants`` benchmark scenario's arithmetic: how B's wait grows with A's backlog, and the
tenants' broker addresses in the bench's vhost."""

from __future__ import annotations

import math

from tests.bench.tenants import Round, bound, user_url, vhost_of


def test_b_waits_grow_is_fitted_per_a_turn_ahead_of_it_through_the_wait_alone() -> None:
    rounds = [
        Round(backlog=0, b_started_s=0.010),
        Round(backlog=100, b_started_s=0.210, cpu_ahead_s=0.15),
        Round(backlog=1000, b_started_s=2.010, cpu_ahead_s=1.7),
    ]
    fit = bound(rounds)
    assert fit["base_ms"] == 10.0
    assert fit["wait_ms_per_a_turn"] == 2.0
    assert fit["cpu_ms_per_a_turn_ahead"] == 1.6  # the median of 1.5 and 1.7


def test_no_backlog_has_no_growth_to_fit_and_a_round_without_b_started_is_left_out() -> None:
    assert bound([Round(backlog=0, b_started_s=0.012)]) == {"base_ms": 12.0}
    fit = bound([Round(backlog=0, b_started_s=0.0), Round(backlog=10), Round(backlog=20)])
    assert fit == {"base_ms": 0.0}
    assert math.isnan(Round(backlog=0).cpu_ahead_ms_per_turn)


def test_tenant_users_log_in_to_the_benchs_vhost() -> None:
    url = "amqp://guest:guest@127.0.0.1:5672/lw_bench"
    assert vhost_of(url) == "lw_bench"
    assert vhost_of("amqp://guest:guest@rabbit/") == "/"
    assert vhost_of("amqp://rabbit:5673/%2F") == "/"
    assert user_url(url, "lwbench-a", "pw") == "amqp://lwbench-a:pw@127.0.0.1:5672/lw_bench"
    assert user_url("amqp://rabbit/", "u", "p") == "amqp://u:p@rabbit:5672/%2F"
