"""``loopwire agents check`` and ``loopwire agents list``, as a deploy pipeline runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "agents", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def test_check_accepts_the_shipped_file_and_list_prints_every_agent_and_workflow() -> None:
    checked = cli("check", "deploy/agents.json")
    assert checked.returncode == 0, checked.stderr
    assert "5 agent(s), 1 workflow(s): ok" in checked.stdout
    listed = cli("list", "deploy/agents.json", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in map(json.loads, listed.stdout.splitlines())}
    assert set(rows) == {"support", "researcher", "billing", "classifier", "default", "triage"}
    assert rows["support"]["agents"] == ["researcher"]
    assert rows["support"]["provider"] == "default" and len(rows["support"]["prompt_version"]) == 12
    assert rows["triage"]["kind"] == "workflow (conditional)"


def test_check_lists_every_problem_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "agents.json"
    bad.write_text(
        json.dumps(
            {
                "agents": [
                    {"name": "a", "provider": "ghost"},
                    {"name": "b", "hooks": ["nowhere.at_all:Hook"]},
                ]
            }
        )
    )
    checked = cli("check", str(bad))
    assert checked.returncode == 2
    assert "provider 'ghost', which is not configured" in checked.stderr
    assert "agent 'b', hook set 'nowhere.at_all:Hook': cannot import" in checked.stderr
    unreadable = cli("check", str(tmp_path / "missing.json"))
    assert unreadable.returncode == 2 and "missing.json" in unreadable.stderr


def test_check_knows_the_providers_of_its_environment(tmp_path: Path) -> None:
    path = tmp_path / "agents.json"
    path.write_text(json.dumps({"agents": [{"name": "a", "provider": "backup"}]}))
    env = {
        "PATH": "/usr/bin:/bin",
        "LOOPWIRE_PROVIDERS": json.dumps({"backup": {"base_url": "http://x/v1"}}),
    }
    assert cli("check", str(path), env=env).returncode == 0
