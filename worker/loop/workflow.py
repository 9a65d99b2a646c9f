"""Workflows: agents composed without a model of their own, declared in the agents file beside
the agents and addressed by name like one.

A workflow turn runs in rounds, one step each: a round starts child turns (one per node it
runs, ``worker.loop.children``), the turn parks until they answer, and the next step plans the
next round from the answers its steps recorded. What runs next is a pure function of those
answers (``plan``), so a step redone after a crash plans the same round, with the same call ids
and so the same child turn ids: a finished node is never run again.

Kinds:

- ``sequential``: ``nodes`` in order; each node's input is the previous node's answer (the
  first one's: the turn's input), or its ``input`` template.
- ``parallel``: every node of ``nodes`` at once, on the turn's input; then the answers
  together (``[<id>]`` and the answer, for each node; ``output`` maps ids to answers), or, with
  ``join``, a node that is given them (``{answers}``) and whose answer is the workflow's.
- ``conditional``: ``node`` runs first; the field ``on`` of its structured output picks a
  node of ``routes`` (by the value as text), else ``default``; that node gets the turn's input
  and its answer is the workflow's.
- ``loop``: ``node`` runs on the turn's input, then on its own previous answer, until the
  ``until`` condition holds on its structured output or ``max_rounds`` rounds ran.

Templates name the turn's input ``{input}``, an earlier node's answer ``{<id>}`` and a field of
its structured output ``{<id>.<field>}``; a loop's node also ``{previous}`` and ``{round}``,
a parallel join ``{answers}``. A node that fails (its turn ends with an error, is cancelled or
stops at its iteration cap) fails the workflow turn (``node_failed``): there is no model to
read the error. A workflow is checked when the agents file loads (``worker.profiles.agents``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from pydantic import Field, model_validator

from contracts.base import AgentName, Contract
from contracts.state import ExecutionState, StepExecution, ToolExecution

WorkflowKind = Literal["sequential", "parallel", "conditional", "loop"]
_PLACEHOLDER = re.compile(r"\{([A-Za-z0-9_-]+)(?:\.([A-Za-z0-9_-]+))?\}")
JOIN_ID = "_join"
"""The call id of a parallel workflow's join (node ids cannot start with ``_``)."""


class Node(Contract):
    """One node: the agent or workflow it runs, and its input."""

    run: AgentName = Field(description="An agent or a workflow of the agents file.")
    id: AgentName | None = Field(
        default=None, description="How templates and results name it (default: 'run')."
    )
    input: str | None = Field(
        default=None, max_length=100_000, description="A template; default: see the kind."
    )

    @property
    def key(self) -> str:
        return self.id or self.run


class Until(Contract):
    """A condition on a node's structured output: ``field`` equals ``equals``."""

    field: str = Field(min_length=1, max_length=128)
    equals: Any


class Workflow(Contract):
    name: AgentName
    description: str = Field(default="", max_length=8000)
    kind: WorkflowKind
    nodes: tuple[Node, ...] = Field(default=(), max_length=32)
    join: Node | None = None
    node: Node | None = None
    on: str | None = Field(default=None, max_length=128)
    routes: dict[str, Node] = Field(default_factory=dict)
    default: Node | None = None
    until: Until | None = None
    max_rounds: int = Field(default=3, ge=1, le=50)

    @model_validator(mode="after")
    def _shape(self) -> Workflow:
        needs = {
            "sequential": ("nodes",),
            "parallel": ("nodes",),
            "conditional": ("node", "on", "routes"),
            "loop": ("node",),
        }[self.kind]
        for name in needs:
            if not getattr(self, name):
                raise ValueError(f"a {self.kind} workflow needs {name!r}")
        allowed = {
            "sequential": {"nodes"},
            "parallel": {"nodes", "join"},
            "conditional": {"node", "on", "routes", "default"},
            "loop": {"node", "until", "max_rounds"},
        }[self.kind]
        for name in ("nodes", "join", "node", "on", "routes", "default", "until"):
            if name not in allowed and getattr(self, name):
                raise ValueError(f"{name!r} does not belong to a {self.kind} workflow")
        keys = [n.key for n in self.nodes]
        if self.kind == "conditional":  # its branches are alternatives: one of them runs
            assert self.node is not None
            keys = [self.node.key, *{n.key for n in self.all_nodes() if n is not self.node}]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"node ids must differ: {', '.join(twice)} (give them 'id's)")
        for node, names in self._template_names():
            if node.input is None:
                continue
            for found in _PLACEHOLDER.finditer(node.input):
                if found.group(1) not in names:
                    known = ", ".join(sorted(names))
                    raise ValueError(
                        f"node {node.key!r}: the template names {found.group(0)}, which is not "
                        f"one of {known}"
                    )
        return self

    def all_nodes(self) -> list[Node]:
        found = [*self.nodes]
        found += [n for n in (self.join, self.node, self.default) if n is not None]
        return [*found, *self.routes.values()]

    def _template_names(self) -> list[tuple[Node, set[str]]]:
        """Each node and the names its template may use."""
        if self.kind == "sequential":
            return [
                (n, {"input", *(m.key for m in self.nodes[:i])}) for i, n in enumerate(self.nodes)
            ]
        if self.kind == "parallel":
            pairs = [(n, {"input"}) for n in self.nodes]
            if self.join is not None:
                pairs.append((self.join, {"input", "answers", *(n.key for n in self.nodes)}))
            return pairs
        assert self.node is not None
        if self.kind == "conditional":
            branches = [*self.routes.values(), *([self.default] if self.default else [])]
            return [(self.node, {"input"}), *((n, {"input", self.node.key}) for n in branches)]
        return [(self.node, {"input", "previous", "round"})]


# -- planning -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """A node's answer as its step recorded it."""

    text: str
    output: Any
    error: str | None


@dataclass(frozen=True, slots=True)
class NodeCall:
    """A node to run in this round: the call id (its child turn id derives from it), what it
    runs, its input."""

    call_id: str
    run: str
    input: str


@dataclass(frozen=True, slots=True)
class Round:
    calls: tuple[NodeCall, ...]


@dataclass(frozen=True, slots=True)
class Done:
    content: str
    output: Any


@dataclass(frozen=True, slots=True)
class NodeFailed:
    node: str
    error: str


Plan = Round | Done | NodeFailed


class SoFar(NamedTuple):
    """What a workflow turn has to plan its next round from: its input, the answers of each
    round, all of them by call id, and the names its templates may use."""

    given: str
    rounds: Sequence[Mapping[str, Answer]]
    done: Mapping[str, Answer]
    names: Mapping[str, Any]


def answer_of(execution: ToolExecution) -> Answer:
    value = execution.value
    return Answer(
        text=execution.content,
        output=None if isinstance(value, str) else value,
        error=execution.error if execution.outcome != "ok" else None,
    )


def rounds_of(records: Sequence[StepExecution]) -> list[dict[str, Answer]]:
    """The answers of each round the turn completed (its step records), by call id."""
    return [{e.call_id: answer_of(e) for e in record.step.tool_executions} for record in records]


def input_text(ex: ExecutionState) -> str:
    return "\n\n".join(m.content for m in ex.request.input)


def plan(flow: Workflow, given: str, rounds: Sequence[Mapping[str, Answer]]) -> Plan:
    """What the workflow does next, from the turn's input and the answers of its rounds."""
    for answers in rounds:
        for call_id, answer in answers.items():
            if answer.error is not None:
                return NodeFailed(call_id, answer.error)
    done = {k: v for answers in rounds for k, v in answers.items()}
    names: dict[str, Any] = {"input": given, **done}
    planner = {
        "sequential": _sequential,
        "parallel": _parallel,
        "conditional": _conditional,
        "loop": _loop,
    }[flow.kind]
    return planner(flow, SoFar(given, rounds, done, names))


def _sequential(flow: Workflow, so_far: SoFar) -> Plan:
    given, rounds, done, names = so_far
    n = len(rounds)
    if n == len(flow.nodes):
        return _done(done[flow.nodes[-1].key])
    node = flow.nodes[n]
    default = done[flow.nodes[n - 1].key].text if n else given
    return Round((_call(node, node.key, names, default),))


def _parallel(flow: Workflow, so_far: SoFar) -> Plan:
    given, rounds, done, names = so_far
    if not rounds:
        return Round(tuple(_call(node, node.key, names, given) for node in flow.nodes))
    together = "\n\n".join(f"[{node.key}]\n{done[node.key].text}" for node in flow.nodes)
    if flow.join is None:
        output = {node.key: _value(done[node.key]) for node in flow.nodes}
        return Done(together, output)
    if len(rounds) == 1:
        joined = {**names, "answers": together}
        return Round((_call(flow.join, JOIN_ID, joined, together),))
    return _done(done[JOIN_ID])


def _conditional(flow: Workflow, so_far: SoFar) -> Plan:
    given, rounds, done, names = so_far
    assert flow.node is not None
    if not rounds:
        return Round((_call(flow.node, flow.node.key, names, given),))
    if len(rounds) == 1:
        routed = done[flow.node.key].output
        value = routed.get(flow.on) if isinstance(routed, dict) else None
        branch = flow.routes.get(_as_key(value), flow.default)
        if branch is None:
            return NodeFailed(flow.node.key, f"no route for {flow.on}={value!r} and no default")
        return Round((_call(branch, branch.key, names, given),))
    return _done(next(iter(rounds[1].values())))


def _loop(flow: Workflow, so_far: SoFar) -> Plan:
    given, rounds, _, names = so_far
    assert flow.node is not None
    key, n = flow.node.key, len(rounds)
    if not n:
        return Round((_call(flow.node, f"{key}-0", {**names, "round": "0"}, given),))
    last = rounds[-1][f"{key}-{n - 1}"]
    if n == flow.max_rounds or (flow.until is not None and _holds(flow.until, last.output)):
        return _done(last)
    looped = {**names, "previous": last.text, "round": str(n)}
    return Round((_call(flow.node, f"{key}-{n}", looped, last.text),))


def _value(answer: Answer) -> Any:
    return answer.output if answer.output is not None else answer.text


def _done(answer: Answer) -> Done:
    return Done(answer.text, answer.output)


def _call(node: Node, call_id: str, names: Mapping[str, Any], default: str) -> NodeCall:
    text = default if node.input is None else render(node.input, names)
    return NodeCall(call_id=call_id, run=node.run, input=text)


def render(template: str, names: Mapping[str, Any]) -> str:
    """The template with each placeholder replaced (checked when the workflow loaded)."""

    def one(found: re.Match[str]) -> str:
        value = names.get(found.group(1), "")
        if isinstance(value, Answer):
            if found.group(2) is not None:
                field = value.output.get(found.group(2)) if isinstance(value.output, dict) else None
                return _text(field)
            return value.text
        return _text(value)

    return _PLACEHOLDER.sub(one, template)


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _as_key(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value)


def _holds(until: Until, output: Any) -> bool:
    return isinstance(output, dict) and output.get(until.field) == until.equals
