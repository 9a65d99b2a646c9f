"""Settings read from files (``LOOPWIRE_<NAME>_FILE``), as Docker and Kubernetes secrets are
handed to a container."""

from __future__ import annotations

from pathlib import Path

import pytest

from tool_services.settings import Settings as ToolSettings
from worker.settings import Settings


def secret(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_urls_and_the_model_key_come_from_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    amqp = secret(tmp_path, "amqp", "amqp://worker:pa55@rabbit:5672/\n")
    monkeypatch.setenv("LOOPWIRE_AMQP_URL_FILE", amqp)
    monkeypatch.setenv("LOOPWIRE_REDIS_URL_FILE", secret(tmp_path, "redis", "redis://:pw@r:6379/0"))
    monkeypatch.setenv("LOOPWIRE_MODEL__API_KEY_FILE", secret(tmp_path, "key", "sk-123\n"))
    monkeypatch.setenv("LOOPWIRE_MODEL__MODEL", "gpt-x")  # the rest of the group stays
    settings = Settings()
    assert settings.amqp_url == "amqp://worker:pa55@rabbit:5672/"
    assert settings.redis_url == "redis://:pw@r:6379/0"
    assert settings.model.api_key.get_secret_value() == "sk-123"
    assert settings.model.model == "gpt-x"
    assert ToolSettings().amqp_url == "amqp://worker:pa55@rabbit:5672/"


def test_a_setting_given_both_ways_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOPWIRE_AMQP_URL", "amqp://a/")
    monkeypatch.setenv("LOOPWIRE_AMQP_URL_FILE", secret(tmp_path, "amqp", "amqp://b/"))
    with pytest.raises(ValueError, match="LOOPWIRE_AMQP_URL or LOOPWIRE_AMQP_URL_FILE"):
        Settings()


def test_an_unreadable_file_is_named_and_nothing_of_it_is_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nope"
    monkeypatch.setenv("LOOPWIRE_REDIS_URL_FILE", str(missing))
    with pytest.raises(ValueError, match=f"LOOPWIRE_REDIS_URL_FILE: cannot read {missing}"):
        Settings()


def test_a_setting_named_like_a_file_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agents = secret(tmp_path, "agents.json", '{"agents": []}')
    monkeypatch.setenv("LOOPWIRE_AGENTS_FILE", agents)  # a path setting, not a secret
    assert str(Settings().agents_file) == agents
