"""The JSON Schema export: the checked-in files match the models, and the CLI writes them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from contracts.schema import PUBLIC_CONTRACTS, schemas

REPO = Path(__file__).resolve().parents[2]
SCHEMA_DIR = REPO / "contracts" / "schema_json"
REGENERATE = "run `loopwire schema --out contracts/schema_json` and commit the result"


def expected_files() -> set[str]:
    return {f"{name}.schema.json" for name in PUBLIC_CONTRACTS}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )


@pytest.mark.parametrize("name", list(PUBLIC_CONTRACTS))
def test_checked_in_schema_is_up_to_date(name: str) -> None:
    path = SCHEMA_DIR / f"{name}.schema.json"
    assert path.is_file(), f"{path.relative_to(REPO)} is missing; {REGENERATE}"
    checked_in: Any = json.loads(path.read_text(encoding="utf-8"))
    current = schemas()[name]
    assert checked_in == current, (
        f"{path.relative_to(REPO)} is out of date with {name}; {REGENERATE}"
    )


def test_no_stale_schema_files() -> None:
    present = {path.name for path in SCHEMA_DIR.glob("*.schema.json")}
    stale = present - expected_files()
    assert not stale, f"schema files for no public contract: {sorted(stale)}; {REGENERATE}"


def test_cli_writes_one_schema_per_public_contract(tmp_path: Path) -> None:
    out = tmp_path / "schemas"
    completed = run_cli("schema", "--out", str(out))
    assert completed.returncode == 0, completed.stderr
    assert {path.name for path in out.iterdir()} == expected_files()
    current = schemas()
    for name in PUBLIC_CONTRACTS:
        document = json.loads((out / f"{name}.schema.json").read_text(encoding="utf-8"))
        assert isinstance(document, dict)
        assert isinstance(document.get("properties"), dict), f"{name} has no properties"
        assert document["properties"], f"{name} has empty properties"
        assert document.get("title") == name
        assert document == current[name]


def test_cli_output_matches_the_checked_in_files(tmp_path: Path) -> None:
    completed = run_cli("schema", "--out", str(tmp_path))
    assert completed.returncode == 0, completed.stderr
    for name in expected_files():
        written = (tmp_path / name).read_text(encoding="utf-8")
        checked_in = (SCHEMA_DIR / name).read_text(encoding="utf-8")
        assert written == checked_in, f"contracts/schema_json/{name} differs; {REGENERATE}"


def test_cli_writes_all_schemas_to_stdout() -> None:
    completed = run_cli("schema", "--out", "-")
    assert completed.returncode == 0, completed.stderr
    documents = json.loads(completed.stdout)
    assert set(documents) == set(PUBLIC_CONTRACTS)
    assert all("properties" in document for document in documents.values())
