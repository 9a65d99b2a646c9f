"""Every problem of an agents file, in one pass, each as a sentence.

``AgentProfiles.load`` stops at the first problem (pydantic validates the whole file, and the
references between agents and workflows are checked one after the other). ``problems`` checks
each agent and each workflow on its own, then the names (two agents or workflows of one name
are refused: a worker would use the first), the references between them, the providers and
the hook sets, and returns every problem found: ``loopwire agents check`` lists them all, and
a worker that cannot load the file logs them all.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from worker.profiles.agents import AgentProfile, AgentProfiles, WorkflowProfile, _check_workflow
from worker.redaction.service import Redaction


def problems(path: Path, providers: Iterable[str], redaction: Redaction | None = None) -> list[str]:
    """Every problem of the agents file at ``path`` (none: a worker loads it)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        return [f"cannot read it: {exc.strerror or exc}"]
    except ValueError as exc:
        return [f"not JSON: {exc}"]
    if not isinstance(data, dict) or not isinstance(data.get("agents"), list):
        return ['it must be a JSON object with a list of agents: {"agents": [...]}']
    found: list[str] = [
        f"unknown key {key!r} (agents, workflows)"
        for key in data
        if key not in ("agents", "workflows")
    ]
    flows_data = data.get("workflows", [])
    if not isinstance(flows_data, list):
        found.append("'workflows' must be a list")
        flows_data = []
    agents = _each(data["agents"], AgentProfile, "agent", found)
    flows = _each(flows_data, WorkflowProfile, "workflow", found)
    for kind, items in (("agents", data["agents"]), ("workflows", flows_data)):
        names = Counter(_name(item) for item in items if _name(item))
        found += [
            f"{count} {kind} are named {name!r}; names must be unique"
            for name, count in names.items()
            if count > 1
        ]
    both = {_name(i) for i in data["agents"]} & {_name(i) for i in flows_data} - {None}
    found += [f"{name!r} is both an agent and a workflow" for name in sorted(both, key=str)]
    by_name = {a.name: a for a in agents}
    flow_names = {w.name: w for w in flows}
    defined = {_name(i) for i in [*data["agents"], *flows_data]} - {None}
    found += [
        f"agent {a.name!r} calls {s.agent!r}, which is not defined"
        for a in agents
        for s in a.agents
        if s.agent not in defined
    ]
    for flow in flows:
        try:
            _check_workflow(flow, by_name, flow_names)
        except ValueError as exc:
            found.append(str(exc))
    from worker.model.providers import check_providers  # the model package imports this one

    found += check_providers(agents, providers)
    found += _hook_problems(agents, redaction)
    if not found and len(agents) == len(data["agents"]) and len(flows) == len(flows_data):
        try:
            AgentProfiles.model_validate(data)
        except ValidationError as exc:  # anything the checks above did not foresee
            found += [_sentence(e) for e in exc.errors(include_url=False)]
    return found


def _name(item: Any) -> str | None:
    name = item.get("name") if isinstance(item, dict) else None
    return name if isinstance(name, str) else None


def _each(items: list[Any], model: type[BaseModel], what: str, found: list[str]) -> list[Any]:
    """The items as ``model``, a sentence in ``found`` for each problem. An item with problems
    is checked further without the settings that have them (so that a misspelt setting does
    not hide a bad provider or an undefined reference of the same agent); one that still does
    not validate is left out."""
    checked = []
    for i, item in enumerate(items):
        name = item.get("name") if isinstance(item, dict) else None
        label = f"{what} {name!r}" if isinstance(name, str) else f"{what} #{i + 1}"
        try:
            checked.append(model.model_validate(item))
            continue
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            found += [f"{label}: {_sentence(e)}" for e in errors]
        bad = {e["loc"][0] for e in errors if e["loc"] and e["loc"][0] in item} - {"name"}
        if isinstance(item, dict) and bad:
            with contextlib.suppress(ValidationError):
                checked.append(
                    model.model_validate({k: v for k, v in item.items() if k not in bad})
                )
    return checked


def _sentence(error: Any) -> str:
    from contracts.runtime.loading import sentence

    where = ".".join(str(p) for p in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown setting (a misspelling?)"
    text = sentence(str(error["msg"]))
    return f"{where}: {text}" if where else text


def _hook_problems(agents: list[AgentProfile], redaction: Redaction | None) -> list[str]:
    from worker.profiles.hooksets import _factory

    found = []
    for profile in agents:
        for name in profile.hooks:
            try:
                _factory(profile, name, redaction)
            except ValueError as exc:
                found.append(f"agent {profile.name!r}, hook set {name!r}: {exc}")
    return found
