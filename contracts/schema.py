"""JSON Schema export of the public contracts, for publishers and subscribers in other languages.

The schemas describe the msgpack bodies: msgpack maps are JSON objects, so any
language's msgpack library plus these schemas is enough to speak loopwire.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from contracts.control import TurnCancel, TurnChildResult, TurnDecision
from contracts.events import Event
from contracts.sessions import SessionDelete, SessionQuery, SessionReply
from contracts.state import AgentState
from contracts.tools import ToolCallReply, ToolCallRequest, ToolDefinition
from contracts.turns import TurnRejection, TurnRequest, TurnResult

PUBLIC_CONTRACTS: dict[str, type[BaseModel]] = {
    "TurnRequest": TurnRequest,
    "TurnResult": TurnResult,
    "TurnRejection": TurnRejection,
    "TurnCancel": TurnCancel,
    "TurnDecision": TurnDecision,
    "TurnChildResult": TurnChildResult,
    "SessionQuery": SessionQuery,
    "SessionDelete": SessionDelete,
    "SessionReply": SessionReply,
    "Event": Event,
    "ToolDefinition": ToolDefinition,
    "ToolCallRequest": ToolCallRequest,
    "ToolCallReply": ToolCallReply,
    "AgentState": AgentState,
}


def schemas() -> dict[str, dict[str, Any]]:
    return {
        name: model.model_json_schema(mode="validation") for name, model in PUBLIC_CONTRACTS.items()
    }


def write_schemas(out: str) -> int:
    documents = schemas()
    if out == "-":
        json.dump(documents, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return 0
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    for name, document in documents.items():
        path = directory / f"{name}.schema.json"
        path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return 0
