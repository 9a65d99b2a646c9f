"""Agent profiles: who the agent is (prompt, model, tools) and its loop limits.

Profiles come from a JSON file (``LOOPWIRE_AGENTS_FILE``) the worker loads at
start: ``{"agents": [{"name": ..., "system_prompt": ..., ...}], "workflows": [...]}``. A turn
names its agent (or workflow: each becomes a profile of its own, whose turns run the workflow
instead of a model, ``worker.loop.workflow``); a turn may override the limits only within the
contract's bounds.

The file is checked as a whole when it loads, and a mistake is refused with a message naming
it: an agent calling an agent that does not exist, a workflow naming one, workflows that
contain each other, a condition on a field that the node's output schema does not have.

``mcp`` marks an agent or workflow that ``loopwire mcp serve`` offers as an MCP tool
(``worker.cli.mcp``); the workers themselves ignore it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import BeforeValidator, Field, model_validator

from contracts.base import Contract
from contracts.turns import NO_BUDGET, Budget
from worker.loop.output import check_schema
from worker.loop.spec import AgentSpec
from worker.loop.workflow import Node, Workflow
from worker.redaction import REDACT
from worker.redaction.config import RedactionConfig


class McpExposure(Contract):
    """How ``loopwire mcp serve`` offers an agent or workflow as an MCP tool (``"mcp": true``
    is ``"mcp": {}``)."""

    description: str | None = Field(
        default=None,
        max_length=8000,
        description="What the MCP client is told of the tool; default: the agent's description.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_flag(cls, value: Any) -> Any:
        return {} if value is True else value


def _exposure(value: Any) -> Any:
    return None if value is False else value


class AgentProfile(AgentSpec):
    """An agent as the agents file declares it: the loop's ``AgentSpec`` plus the hook sets to
    enable and their configuration."""

    hooks: tuple[str, ...] = Field(
        default=(),
        description="Hook sets to enable, in order: built-in names ('redact') or import paths "
        "('mypkg.guards:NoRefunds', a worker.loop.hooks.Hook subclass); see docs/hooks.md.",
    )
    hook_config: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Configuration of hook sets given by import path, by their name in 'hooks'; "
        "validated by the hook's own Config model.",
    )
    redaction: RedactionConfig = Field(
        default_factory=RedactionConfig,
        description="Configuration of the 'redact' hook set (worker.redaction).",
    )
    mcp: Annotated[McpExposure | None, BeforeValidator(_exposure)] = Field(
        default=None,
        description="Offer the agent as an MCP tool through 'loopwire mcp serve' (docs/mcp.md).",
    )

    def model_post_init(self, context: Any, /) -> None:
        """Keeps ``model_fields_set`` (which contracts drop): ``_redaction_enabled`` reads it."""

    @model_validator(mode="after")
    def _redaction_enabled(self) -> AgentProfile:
        # A redaction block without the hook set would quietly send raw values to the model.
        if "redaction" in self.model_fields_set and REDACT not in self.hooks:
            raise ValueError(f"'redaction' is configured but {REDACT!r} is not in 'hooks'")
        if self.output_schema is not None:
            check_schema(self.output_schema)  # a ValueError names the problem
        for name in self.hook_config:
            if name not in self.hooks or name == REDACT:
                raise ValueError(
                    f"'hook_config' names {name!r}, which is not a hook set in 'hooks'"
                )
        return self


class ProfileLookup(Protocol):
    """Where a worker finds an agent's profile: ``AgentProfiles``, or the profiles a running
    worker reloads (``worker.profiles.source.ProfileSource``)."""

    def get(self, name: str) -> AgentProfile | None: ...


class WorkflowProfile(Workflow):
    """A workflow as the agents file declares it: the workflow and what its turns may spend."""

    budget: Budget = Field(
        default=NO_BUDGET, description="What one turn may spend, nodes' included."
    )
    children_timeout_s: float = Field(
        default=AgentSpec.model_fields["children_timeout_s"].default,
        gt=0,
        le=7 * 24 * 3600,
        description="A node that has not answered this long ends as an error, and is cancelled.",
    )
    mcp: Annotated[McpExposure | None, BeforeValidator(_exposure)] = Field(
        default=None,
        description="Offer the workflow as an MCP tool through 'loopwire mcp serve' (docs/mcp.md).",
    )


class AgentProfiles(Contract):
    agents: tuple[AgentProfile, ...]
    workflows: tuple[WorkflowProfile, ...] = ()

    @model_validator(mode="after")
    def _composed(self) -> AgentProfiles:
        """Checks what the agents and workflows name, and adds a profile for each workflow."""
        for kind, names in (
            ("agents", [a.name for a in self.agents]),
            ("workflows", [w.name for w in self.workflows]),
        ):
            for name in sorted({n for n in names if names.count(n) > 1}):
                raise ValueError(
                    f"{names.count(name)} {kind} are named {name!r}; names must be unique"
                )
        agents = {a.name: a for a in self.agents}
        flows = {w.name: w for w in self.workflows}
        for name in agents.keys() & flows.keys():
            raise ValueError(f"{name!r} is both an agent and a workflow")
        described = {
            **{a.name: a.description for a in self.agents},
            **{w.name: w.description for w in self.workflows},
        }
        profiles = []
        for agent in self.agents:
            subs = []
            for sub in agent.agents:
                if sub.agent not in described:
                    raise ValueError(
                        f"agent {agent.name!r} calls {sub.agent!r}, which is not defined"
                    )
                if sub.description is None and described[sub.agent]:
                    sub = sub.model_copy(update={"description": described[sub.agent]})
                subs.append(sub)
            profiles.append(agent.model_copy(update={"agents": tuple(subs)}) if subs else agent)
        for flow in self.workflows:
            _check_workflow(flow, agents, flows)
            profiles.append(
                AgentProfile(
                    name=flow.name,
                    description=flow.description,
                    tools=(),
                    budget=flow.budget,
                    children_timeout_s=flow.children_timeout_s,
                    mcp=flow.mcp,
                    workflow=Workflow.model_validate(
                        flow.model_dump(exclude={"budget", "children_timeout_s", "mcp"})
                    ),
                )
            )
        # the profiles with the workflows' added (set in place: a validator of a model built by
        # its constructor must return the model itself)
        self.__dict__["agents"] = tuple(profiles)
        return self

    def get(self, name: str) -> AgentProfile | None:
        return next((a for a in self.agents if a.name == name), None)

    @classmethod
    def load(cls, path: Path) -> AgentProfiles:
        return cls.model_validate(json.loads(path.read_text(encoding="utf-8")))


def _check_workflow(
    flow: Workflow, agents: dict[str, AgentProfile], flows: dict[str, WorkflowProfile]
) -> None:
    for node in flow.all_nodes():
        if node.run not in agents and node.run not in flows:
            raise ValueError(
                f"workflow {flow.name!r}: node {node.key!r} runs {node.run!r}, which is neither "
                "an agent nor a workflow"
            )
    cycle = _cycle(flow.name, flows, ())
    if cycle:
        raise ValueError(f"workflows contain each other: {' -> '.join(cycle)}")
    assert flow.node is not None or flow.kind in ("sequential", "parallel")
    if flow.kind == "conditional":
        assert flow.node is not None and flow.on is not None
        field = _output_field(flow, flow.node, flow.on, agents, "routes on")
        values = field.get("enum")
        if isinstance(values, list):
            known = {v if isinstance(v, str) else json.dumps(v) for v in values}
            for key in flow.routes:
                if key not in known:
                    raise ValueError(
                        f"workflow {flow.name!r}: route {key!r} is not a value of "
                        f"{flow.node.run}'s {flow.on!r} ({', '.join(sorted(known))})"
                    )
    if flow.kind == "loop" and flow.until is not None:
        assert flow.node is not None
        _output_field(flow, flow.node, flow.until.field, agents, "loops until")


def _output_field(
    flow: Workflow, node: Node, field: str, agents: dict[str, AgentProfile], verb: str
) -> dict[str, Any]:
    """The schema of ``field`` in the structured output of the agent ``node`` runs."""
    agent = agents.get(node.run)
    schema = agent.output_schema if agent is not None else None
    if schema is None:
        raise ValueError(
            f"workflow {flow.name!r} {verb} {field!r} of node {node.key!r}, but {node.run!r} is "
            "not an agent with an output_schema"
        )
    properties = schema.get("properties")
    if not isinstance(properties, dict) or field not in properties:
        raise ValueError(
            f"workflow {flow.name!r} {verb} {field!r} of node {node.key!r}, but the "
            f"output_schema of {node.run!r} has no such property"
        )
    found = properties[field]
    return found if isinstance(found, dict) else {}


def _cycle(name: str, flows: dict[str, WorkflowProfile], path: tuple[str, ...]) -> tuple[str, ...]:
    """A chain of workflows from ``name`` back to one already on ``path``, if there is one."""
    if name in path:
        return (*path[path.index(name) :], name)
    flow = flows.get(name)
    if flow is None:
        return ()
    for node in flow.all_nodes():
        found = _cycle(node.run, flows, (*path, name))
        if found:
            return found
    return ()
