"""The README is the contract with users: every setting and name it must document is there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import BaseModel

from contracts import topology
from contracts.events import EVENT_TYPES
from contracts.schema import PUBLIC_CONTRACTS
from tool_services.settings import Settings as ToolSettings
from worker.settings import Settings as WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def env_names(model: type[BaseModel], prefix: str = "LOOPWIRE_") -> list[str]:
    names = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names += env_names(annotation, f"{prefix}{name.upper()}__")
        else:
            names.append(f"{prefix}{name.upper()}")
    return names


@pytest.mark.parametrize("name", sorted(set(env_names(WorkerSettings) + env_names(ToolSettings))))
def test_every_setting_is_documented(name: str) -> None:
    assert f"`{name}`" in README, f"{name} is missing from the README's configuration reference"


@pytest.mark.parametrize(
    "name",
    [
        topology.TURNS_QUEUE,
        topology.DEAD_LETTER_QUEUE,
        topology.TOOLS_EXCHANGE,
        topology.EVENTS_EXCHANGE,
        topology.RETRY_QUEUE,
        topology.H_REASON,
        topology.H_KIND,
        topology.H_IDEMPOTENCY_KEY,
        *EVENT_TYPES,
        *PUBLIC_CONTRACTS,
    ],
)
def test_every_wire_name_is_documented(name: str) -> None:
    assert name in README


@pytest.mark.parametrize("script", ["scripts/demo", "scripts/test", "scripts/bench", ".ci/run"])
def test_the_commands_exist_and_are_executable(script: str) -> None:
    path = ROOT / script
    assert path.is_file()
    assert os.access(path, os.X_OK)
    assert f"./{script}" in README or script == ".ci/run"
