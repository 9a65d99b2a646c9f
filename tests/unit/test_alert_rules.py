"""The shipped alert rules: valid (``promtool check rules``), firing when they should and not
otherwise (``promtool test rules`` over deploy/prometheus/alerts.test.yml), loaded by the
shipped Prometheus configuration (``promtool check config``), and every metric they name one
that loopwire or RabbitMQ's plugin exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from tool_services.metrics import ToolServiceMetrics
from worker.runtime.metrics import WorkerMetrics

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def promtool(*args: str) -> str:
    tool = shutil.which("promtool")
    assert tool, "promtool is not installed (scripts/lib.sh installs Debian's prometheus)"
    done = subprocess.run(
        [tool, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_rules_are_valid_and_their_unit_tests_pass() -> None:
    assert "SUCCESS: 8 rules found" in promtool("check", "rules", "alerts.yml")
    assert "SUCCESS" in promtool("test", "rules", "alerts.test.yml")


def test_the_shipped_configuration_loads_the_rules() -> None:
    out = promtool("check", "config", "prometheus.yml")
    assert "alerts.yml" in out and "SUCCESS" in out


def test_every_alert_is_tested_and_names_metrics_that_exist() -> None:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"][0]["rules"]
    tests = yaml.safe_load((PROMETHEUS / "alerts.test.yml").read_text())["tests"]
    tested = {case["alertname"] for test in tests for case in test["alert_rule_test"]}
    assert {rule["alert"] for rule in rules} <= tested
    registry = CollectorRegistry()
    WorkerMetrics(registry)
    ToolServiceMetrics(registry, tools={})
    suffixes = {"counter": ("_total",), "histogram": ("_count", "_sum", "_bucket"), "gauge": ("",)}
    exported = {
        family.name + suffix
        for family in registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }
    for rule in rules:
        # the metric names: not the labels of a ``by (...)`` or of a ``{...}`` matcher
        expr = re.sub(r"by \([^)]*\)|\{[^}]*\}", "", rule["expr"])
        for name in re.findall(r"\b((?:loopwire|gen_ai)_[a-z_]+)\b", expr):
            assert name in exported, f"{rule['alert']} names {name}, which nothing exports"
        for name in re.findall(r"\b(rabbitmq_[a-z_]+)\b", expr):
            assert name in {"rabbitmq_detailed_queue_messages", "rabbitmq_detailed_queue_consumers"}
