"""The documentation is the contract with users: every setting and name it must document is there.

Settings are documented in docs/operations.md, wire names in docs/protocol.md; the README stays
short and links to both.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from contracts import topology
from contracts.events import EVENT_TYPES
from contracts.schema import PUBLIC_CONTRACTS
from gateway.http.settings import GatewaySettings
from tool_services.settings import Settings as ToolSettings
from worker.settings import Settings as WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
OPERATIONS = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
PROTOCOL = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")

README_MAX_LINES = 250


def env_names(model: type[BaseModel], prefix: str = "LOOPWIRE_") -> list[str]:
    names = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names += env_names(annotation, f"{prefix}{name.upper()}__")
        else:
            names.append(f"{prefix}{name.upper()}")
    return names


@pytest.mark.parametrize(
    "name",
    sorted(set(env_names(WorkerSettings) + env_names(ToolSettings) + env_names(GatewaySettings))),
)
def test_every_setting_is_documented(name: str) -> None:
    assert f"`{name}`" in OPERATIONS, f"{name} is missing from docs/operations.md"


@pytest.mark.parametrize(
    "name",
    [
        topology.TURNS_QUEUE,
        topology.DEAD_LETTER_EXCHANGE,
        topology.DEAD_LETTER_QUEUE,
        topology.TOOLS_EXCHANGE,
        topology.EVENTS_EXCHANGE,
        topology.RETRY_QUEUE,
        topology.tool_queue("<name>"),
        topology.H_REASON,
        topology.H_REASON_CODE,
        topology.H_KIND,
        topology.H_ATTEMPT,
        topology.H_DEAD_ID,
        topology.H_REJECTED_AT,
        topology.H_IDEMPOTENCY_KEY,
        topology.KIND_START,
        topology.KIND_STEP,
        topology.KIND_CANCEL,
        topology.KIND_DECISION,
        "loopwire.turns.wait.<seconds>",
        topology.CONTENT_TYPE,
        *EVENT_TYPES,
        *PUBLIC_CONTRACTS,
    ],
)
def test_every_wire_name_is_documented(name: str) -> None:
    assert f"`{name}`" in PROTOCOL, f"{name} is missing from docs/protocol.md"


@pytest.mark.parametrize("script", ["scripts/demo", "scripts/test", "scripts/bench", ".ci/run"])
def test_the_commands_exist_and_are_executable(script: str) -> None:
    path = ROOT / script
    assert path.is_file()
    assert os.access(path, os.X_OK)
    assert f"./{script}" in README or script == ".ci/run"


def test_the_readme_stays_short() -> None:
    lines = len(README.splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference into docs/"


DOC_LINK = re.compile(r"\]\((docs/[^)#\s]+\.md)(?:#[^)\s]*)?\)")


def test_the_readme_links_every_docs_page() -> None:
    linked = set(DOC_LINK.findall(README))
    pages = {f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


@pytest.mark.parametrize("link", sorted(set(DOC_LINK.findall(README))))
def test_every_docs_link_in_the_readme_points_at_a_file(link: str) -> None:
    assert (ROOT / link).is_file(), f"README.md links {link}, which does not exist"
