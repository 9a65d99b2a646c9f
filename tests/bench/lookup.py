"""The ``lookup`` tool of the ``long`` scenario: a search-like tool whose result has the size
the call asks for, so that a turn's steps carry tool results of a known size (4 KB, 16 KB).

``lookup({"query": ..., "size": N})`` returns ``{"query": ..., "items": [...]}``, about ``N``
bytes as compact JSON, the same for the same arguments. The items are never empty, so the
loop's empty-streak guard (``items`` is one of its result keys) never appends a hint.

``lookup_result`` is the function: ``tests.bench.lookup_service`` serves it with the tool
services' SDK for loopwire, and the tool protocol floor (``tests.bench.tool_floor``) calls it
for the protocol floor. This module imports no SDK code.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

LOOKUP = "lookup"
DESCRIPTION = (
    "Look up the orders, shipments and notes that match a query. Returns the matching "
    "records, best first."
)
QUERY = "delayed parcels at the regional hub"

_CARRIERS = ("northline", "swiftpost", "parcelway", "cargoquick")
_STATES = ("in transit", "held at hub", "out for delivery", "delivered", "returned")
_NOTE = (
    "customer asked for an update; carrier reports a short delay at the regional hub and "
    "gives a new estimate of two business days"
)


class LookupArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=500, description="What to look for.")
    size: int = Field(
        default=4096, ge=64, le=1_000_000, description="About how many bytes to return."
    )


def arguments(size: int) -> dict[str, Any]:
    """The arguments the bench model sends with every call of the ``long`` scenario."""
    return {"query": QUERY, "size": size}


def definition() -> dict[str, Any]:
    """The tool as the chat-completions API describes it (what the protocol floor offers)."""
    return {
        "type": "function",
        "function": {
            "name": LOOKUP,
            "description": DESCRIPTION,
            "parameters": LookupArgs.model_json_schema(),
        },
    }


def _item(i: int) -> dict[str, Any]:
    return {
        "id": f"ord-{100_000 + i * 7919 % 900_000}",
        "carrier": _CARRIERS[i % len(_CARRIERS)],
        "status": _STATES[i % len(_STATES)],
        "updated": f"2026-11-{1 + i % 28:02d}T{i % 24:02d}:{i * 7 % 60:02d}:00Z",
        "score": round(1.0 - i / 1000, 3),
        "note": _NOTE,
    }


def lookup_result(query: str, size: int) -> dict[str, Any]:
    """About ``size`` bytes of compact JSON: as many items as fit, the last note padded to
    the size (a result is never smaller than its first item)."""
    result: dict[str, Any] = {"query": query, "items": [_item(0)]}
    used = len(orjson.dumps(result))
    while True:
        item = _item(len(result["items"]))
        extra = len(orjson.dumps(item)) + 1
        if used + extra > size:
            break
        result["items"].append(item)
        used += extra
    last = result["items"][-1]
    room = size - used
    if room > 0:
        last["note"] += " " + ("." * (room - 1))
    return result
