"""Every string of a JSON-like value (object keys included), and the value rebuilt with others."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def strings(value: Any) -> list[str]:
    """The strings of ``value`` in a fixed order: depth first, each key before its value."""
    out: list[str] = []
    _collect(value, out)
    return out


def _collect(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                out.append(key)
            _collect(item, out)
    elif isinstance(value, list | tuple):
        for item in value:
            _collect(item, out)


def rebuild(value: Any, replacements: Iterator[str]) -> Any:
    """``value`` with its strings taken, in ``strings`` order, from ``replacements``."""
    if isinstance(value, str):
        return next(replacements)
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            new_key = next(replacements) if isinstance(key, str) else key
            out[new_key] = rebuild(item, replacements)
        return out
    if isinstance(value, list):
        return [rebuild(item, replacements) for item in value]
    if isinstance(value, tuple):
        return tuple(rebuild(item, replacements) for item in value)
    return value
