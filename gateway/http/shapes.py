"""loopwire's sessions, turns and messages in the Agent Protocol's shapes (LangGraph's API, as
the ``langgraph-sdk`` client reads them): a thread is a session, a run is a turn, an assistant
is an agent or a workflow, and a thread's values are ``{"messages": [...]}`` in LangChain's
message form (``type`` ``human``, ``ai``, ``tool`` or ``system``)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from contracts.messages import ChatMessage
from contracts.sessions import SessionSummary, TurnInfo
from contracts.turns import TurnResult

TYPES = {"user": "human", "assistant": "ai", "tool": "tool", "system": "system"}
ROLES = {"human": "user", "user": "user"}
GRAPH_NODE = "agent"
"""The one node a run's updates and message chunks name: a loopwire turn is one loop."""


def iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat()


def message(chat: ChatMessage, index: int, thread_id: str) -> dict[str, Any]:
    """A history message; its id is its place in the thread (``<thread>:<n>``)."""
    shaped: dict[str, Any] = {
        "type": TYPES[chat.role],
        "content": chat.content or "",
        "id": f"{thread_id}:{index}",
        "name": chat.name,
        "additional_kwargs": {},
        "response_metadata": {},
    }
    if chat.role == "assistant":
        shaped["tool_calls"] = [
            {"name": call.name, "args": _args(call.arguments), "id": call.id, "type": "tool_call"}
            for call in chat.tool_calls
        ]
        shaped["invalid_tool_calls"] = []
    if chat.role == "tool":
        shaped["tool_call_id"] = chat.tool_call_id
    return shaped


def values(history: list[ChatMessage], thread_id: str, start: int = 0) -> dict[str, Any]:
    return {"messages": [message(m, start + i, thread_id) for i, m in enumerate(history)]}


def _args(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return {"_raw": text}


def thread(
    thread_id: str,
    *,
    created_at: float,
    metadata: dict[str, Any],
    summary: SessionSummary | None,
    state: dict[str, Any] | None = None,
    interrupts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    status = "idle"
    if summary is not None and summary.running is not None:
        status = "interrupted" if interrupts else "busy"
    return {
        "thread_id": thread_id,
        "created_at": iso(created_at),
        "updated_at": iso(summary.updated_at if summary is not None else created_at),
        "metadata": metadata,
        "status": status,
        "values": state if state is not None else {},
        "interrupts": {summary.running: interrupts} if summary and interrupts else {},
    }


def run_status(info: TurnInfo | None, result: TurnResult | None = None) -> str:
    """A turn's status as a run's: ``pending`` (queued), ``running`` (running or waiting),
    ``success``, ``error``, ``interrupted`` (cancelled) or ``timeout`` (stopped by its
    deadline)."""
    if result is not None:
        if result.finish_reason == "error":
            return "error"
        if result.finish_reason == "cancelled":
            return "timeout" if result.stopped_by == "deadline" else "interrupted"
        return "success"
    if info is None or info.status == "queued":
        return "pending"
    if info.status == "done":
        return "error" if info.finish_reason == "error" else "success"
    return "running"


def run(
    run_id: str,
    thread_id: str,
    assistant_id: str,
    status: str,
    *,
    created_at: float,
    metadata: dict[str, Any] | None = None,
    multitask_strategy: str = "enqueue",
) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "thread_id": thread_id,
        "assistant_id": assistant_id,
        "created_at": iso(created_at),
        "updated_at": iso(created_at),
        "status": status,
        "metadata": metadata or {},
        "multitask_strategy": multitask_strategy,
        "kwargs": {},
    }


def input_texts(payload: Any) -> list[str]:
    """The user messages of a run's ``input`` (``{"messages": [...]}``), as text; a
    ``ValueError`` naming what else it holds."""
    if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
        raise ValueError('input must be {"messages": [...]}')
    texts = []
    for item in payload["messages"]:
        if isinstance(item, str):
            texts.append(item)
            continue
        if not isinstance(item, dict):
            raise ValueError("each input message is an object or a string")
        kind = item.get("role", item.get("type"))
        if kind not in ROLES:
            raise ValueError(
                f"input messages are the user's (role user or type human), not {kind!r}"
            )
        content = item.get("content")
        if isinstance(content, list):  # content blocks: their text parts
            content = "".join(b.get("text", "") for b in content if isinstance(b, dict))
        if not isinstance(content, str) or not content:
            raise ValueError("an input message has no text content")
        texts.append(content)
    if not texts:
        raise ValueError("input has no messages")
    return texts
