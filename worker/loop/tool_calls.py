"""A tool call's pieces as pure functions: what the model reads for a result, the arguments
a call runs with (a reviewer's edit, a rejection), and the session state it is shown."""

from __future__ import annotations

import json
import logging
from typing import Any, NamedTuple

from contracts.messages import ToolCall
from contracts.state import AgentState, ExecutionState, PendingStep, ToolOutcome
from contracts.tools import MAX_STATE_CHARS

log = logging.getLogger("loopwire.tools")


def error_content(message: str) -> str:
    return json.dumps({"error": message}, ensure_ascii=False)


def value_content(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


class Refused(NamedTuple):
    """A call that does not go out: its outcome, the error for the model, its arguments."""

    outcome: ToolOutcome
    error: str
    given: dict[str, Any] | None = None


def call_arguments(call: ToolCall, pending: PendingStep | None) -> dict[str, Any] | Refused:
    """The arguments the call runs with (a reviewer's edit, if any), or why it does not run:
    arguments that are not a JSON object, or a reviewer's rejection."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError as exc:
        return Refused("error", f"arguments are not valid JSON: {exc}")
    if not isinstance(arguments, dict):
        return Refused("error", "arguments must be a JSON object")
    verdict = pending.decisions.get(call.id) if pending is not None else None
    if verdict is None:
        return arguments
    if verdict.decision == "reject":
        who, why = verdict.by or "a reviewer", verdict.message or "no reason given"
        return Refused("blocked", f"rejected by {who}: {why}", arguments)
    return dict(verdict.arguments) if verdict.arguments is not None else arguments


def shared_state(state: AgentState, ex: ExecutionState) -> dict[str, Any]:
    """The session's key-value state as a tool call sees it (a ``persist: false`` turn's own
    updates over it), when it is small enough to send (``MAX_STATE_CHARS``)."""
    kv = state.context.kv
    if ex.state_updates:
        kv = {**kv, **ex.state_updates}
    if not kv:
        return {}
    if len(json.dumps(kv, default=str)) > MAX_STATE_CHARS:
        log.debug("session %s: its state is too large to go with tool calls", state.session_id)
        return {}
    return dict(kv)
