"""``loopwire agents check FILE`` and ``loopwire agents list FILE``: an agents file as a worker
would load it, for the pipelines that deploy profiles.

``check`` runs every check a worker makes at start and on a reload (the file parses, every
profile and workflow validates, every hook set imports with its configuration, every provider
a profile names is configured in this environment's ``LOOPWIRE_PROVIDERS``): exit 0, or 2 with
the problems listed. ``list`` prints each agent and workflow: name, provider, model, prompt
version, tools, hooks (``--json``: one JSON object per line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from worker.errors import CliError, ProfileError
from worker.profiles.agents import AgentProfile

EXIT_OK = 0
EXIT_INVALID = 2


def _loaded(path: Path) -> list[AgentProfile]:
    from worker.model.providers import endpoints
    from worker.profiles.source import check_file
    from worker.settings import load_settings

    try:
        profiles, _ = check_file(path, endpoints(load_settings()))
    except ProfileError as exc:
        raise CliError(str(exc), code=EXIT_INVALID) from None
    return list(profiles.agents)


def run_check(path: Path) -> int:
    agents = _loaded(path)
    flows = sum(1 for a in agents if a.workflow is not None)
    sys.stdout.write(f"{path}: {len(agents) - flows} agent(s), {flows} workflow(s): ok\n")
    return EXIT_OK


def describe(agent: AgentProfile, default_model: str) -> dict[str, object]:
    head = agent.route[0]
    return {
        "name": agent.name,
        "kind": f"workflow ({agent.workflow.kind})" if agent.workflow is not None else "agent",
        "provider": None if agent.workflow is not None else head.provider,
        "model": None
        if agent.workflow is not None
        else head.model or (default_model if head.provider == "default" else None),
        "fallbacks": [f"{c.provider}/{c.model or '-'}" for c in agent.route[1:]],
        "prompt_version": None if agent.workflow is not None else agent.prompt_version,
        "tools": list(agent.tools) if agent.workflow is None else [],
        "agents": [s.agent for s in agent.agents],
        "hooks": list(agent.hooks),
    }


def run_list(path: Path, *, as_json: bool) -> int:
    from worker.settings import load_settings

    default_model = load_settings().model.model
    for agent in _loaded(path):
        found = describe(agent, default_model)
        if as_json:
            sys.stdout.write(json.dumps(found) + "\n")
            continue
        parts = [f"{found['name']:<16} {found['kind']}"]
        if agent.workflow is None:
            parts.append(
                f"{found['provider']}/{found['model'] or '-'} prompt {found['prompt_version']}"
            )
            parts.append(f"tools {','.join(agent.tools) or '-'}")
        if found["agents"]:
            parts.append(f"agents {','.join(s.agent for s in agent.agents)}")
        if agent.hooks:
            parts.append(f"hooks {','.join(agent.hooks)}")
        sys.stdout.write("  ".join(parts) + "\n")
    return EXIT_OK


def run_agents_command(command: str, path: Path, *, as_json: bool = False) -> int:
    if command == "check":
        return run_check(path)
    return run_list(path, as_json=as_json)
