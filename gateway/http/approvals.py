"""Human approval in the Agent Protocol's terms: a run whose turn waits for decisions on tool
calls is *interrupted*; each waiting call is an interrupt (its value: the call id, the tool,
the arguments, until when it may be decided); a run created with ``command: {"resume": ...}``
decides them and the same turn goes on.

The waiting calls are read from the tenant's list of calls waiting for a decision (Redis,
``contracts.keys.approvals_waiting``, as ``loopwire approvals`` reads it). ``resume`` is one
decision for every waiting call (``{"decision": "approve"}``), or one per call id
(``{"<call id>": {"decision": "edit", "arguments": {...}}, ...}``); a decision is ``approve``,
``reject`` (with a ``message`` for the model) or ``edit`` (with the ``arguments`` to run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, cast

from redis.asyncio import Redis

from contracts import keys
from contracts.client import LoopwireClient
from contracts.control import ApprovalRequest
from gateway.http.errors import RunError

Verdict = Literal["approve", "reject", "edit"]
VERDICTS = ("approve", "reject", "edit")


async def waiting(redis: Redis, run_id: str) -> list[ApprovalRequest]:
    """The run's calls waiting for a decision, oldest first."""
    found = [
        ApprovalRequest.model_validate_json(value)
        async for _, value in redis.hscan_iter(keys.approvals_waiting(), match=f"{run_id}:*")
    ]
    return sorted(found, key=lambda a: a.since)


def interrupts(calls: list[ApprovalRequest]) -> list[dict[str, Any]]:
    return [
        {
            "id": call.call_id,
            "value": {
                "call_id": call.call_id,
                "tool": call.tool,
                "arguments": _parsed(call.arguments),
                "until": call.until,
            },
        }
        for call in calls
    ]


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass(frozen=True, slots=True)
class Decision:
    call_id: str
    verdict: Verdict
    message: str | None = None
    arguments: dict[str, Any] | None = None


def decisions(resume: Any, calls: list[ApprovalRequest]) -> list[Decision]:
    """The decisions ``resume`` asks for, one per waiting call; a ``RunError`` (422) saying
    what is wrong with it."""
    ids = [call.call_id for call in calls]
    if isinstance(resume, dict) and "decision" in resume:
        return [_decision(call_id, resume) for call_id in ids]
    if not isinstance(resume, dict) or not resume:
        raise RunError(422, 'resume is {"decision": ...} or {"<call id>": {"decision": ...}}')
    unknown = sorted(set(resume) - set(ids))
    if unknown:
        raise RunError(422, f"no call {unknown[0][:100]!r} waits for a decision (waiting: {ids})")
    return [_decision(call_id, resume[call_id]) for call_id in ids if call_id in resume]


def _decision(call_id: str, given: Any) -> Decision:
    if not isinstance(given, dict) or given.get("decision") not in VERDICTS:
        raise RunError(422, f"call {call_id}: decision is one of {list(VERDICTS)}")
    verdict = cast(Verdict, given["decision"])
    arguments = given.get("arguments")
    if verdict == "edit" and not isinstance(arguments, dict):
        raise RunError(422, f"call {call_id}: an edit gives the arguments to run, as an object")
    message = given.get("message")
    if message is not None and not isinstance(message, str):
        raise RunError(422, f"call {call_id}: message is text")
    return Decision(call_id, verdict, message, arguments if verdict == "edit" else None)


async def decide(
    client: LoopwireClient, thread_id: str, run_id: str, chosen: list[Decision], by: str
) -> None:
    for d in chosen:
        await client.decide(
            run_id,
            d.call_id,
            d.verdict,
            message=d.message,
            arguments=d.arguments,
            by=by,
            session_id=thread_id,
        )
