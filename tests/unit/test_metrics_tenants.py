"""The ``tenant`` label of the worker's metrics: absent unless asked for with tenancy on, and
capped, the tenants past the cap counted as ``other`` (worker.runtime.metrics)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from contracts import tenancy
from contracts.messages import Usage
from contracts.turns import TurnResult
from worker.runtime.metric_bounds import TENANT_LABELLED
from worker.runtime.metrics import TenantLabel, WorkerMetrics
from worker.runtime.tenant_label import tenant_label
from worker.settings import TenancySettings


def observe_a_turn(metrics: WorkerMetrics, tenant: str | None) -> None:
    with tenancy.acting_for(tenant):
        metrics.turn_started("support")
        metrics.step_completed("support", 0.1)
        metrics.model_called("m", Usage(prompt_tokens=3, completion_tokens=2), 0.1)
        metrics.tool_executed("search", "ok", 0.01)
        metrics.turn_finished(
            TurnResult(
                turn_id="t1",
                session_id="s1",
                agent="support",
                finish_reason="stop",
                steps=1,
                duration_s=0.2,
                content="hi",
                completed_at=1.0,
            )
        )
        metrics.dead_letter("poison")


def labels(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Each family's label names, over all its samples (``_created`` aside)."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        if family.name.endswith("_created"):
            continue
        for sample in family.samples:
            found.setdefault(family.name, set()).update(sample.labels)
    return found


def tenants_of(registry: CollectorRegistry, name: str) -> dict[str, float]:
    """``tenant`` -> value of the samples of counter ``name``."""
    return {
        str(s.labels["tenant"]): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
        if s.name == name
    }


def test_the_first_tenants_are_named_and_the_rest_are_other() -> None:
    label = TenantLabel(2)
    assert [label.of(t) for t in ("a", "b", "c", "a", "d", "b")] == [
        "a", "b", "other", "a", "other", "b",
    ]  # fmt: skip
    assert label.of(None) == "_unknown"  # refused before its tenant was known
    assert label.labelled == {"a", "b"}
    with tenancy.acting_for("c"):
        assert label() == "other"
    with tenancy.acting_for("a"):
        assert label() == "a"
    with pytest.raises(ValueError, match="at least 1"):
        TenantLabel(0)


def test_without_the_label_the_series_are_what_they_were() -> None:
    plain, labelled = CollectorRegistry(), CollectorRegistry()
    observe_a_turn(WorkerMetrics(plain), "acme")
    observe_a_turn(WorkerMetrics(labelled, tenants=TenantLabel(5)), "acme")
    without, with_tenant = labels(plain), labels(labelled)
    assert not any("tenant" in names for names in without.values()), without
    assert without.keys() == with_tenant.keys()
    changed = {name for name in without if with_tenant[name] != without[name]}
    assert changed == {
        "loopwire_turns_started",
        "loopwire_turns_finished",
        "loopwire_turn_duration_seconds",
        "loopwire_turn_steps",
        "loopwire_step_duration_seconds",
        "gen_ai_client_token_usage",
        "loopwire_tool_call_duration_seconds",
        "loopwire_dead_lettered",
    }
    assert all(with_tenant[name] == without[name] | {"tenant"} for name in changed)


def test_the_labelled_metrics_count_per_tenant_up_to_the_cap() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, tenants=TenantLabel(2))
    for tenant in ("acme", "globex", "initech", "acme", "umbrella", None):
        observe_a_turn(metrics, tenant)
    assert tenants_of(registry, "loopwire_turns_started_total") == {
        "acme": 2, "globex": 1, "other": 2, "_unknown": 1,
    }  # fmt: skip
    assert tenants_of(registry, "loopwire_dead_lettered_total") == {
        "acme": 2, "globex": 1, "other": 2, "_unknown": 1,
    }  # fmt: skip
    for name in TENANT_LABELLED:
        assert "tenant" in getattr(metrics, name)._labelnames, name


@pytest.mark.parametrize(
    ("enabled", "label", "on"),
    [(False, False, False), (False, True, False), (True, False, False), (True, True, True)],
)
def test_the_label_is_there_only_with_tenancy_on_and_asked_for(
    enabled: bool, label: bool, on: bool
) -> None:
    settings = TenancySettings(enabled=enabled, metrics_label=label, metrics_max_tenants=7)
    made = tenant_label(settings)
    assert (made is not None) == on
    assert made is None or made.cap == 7
