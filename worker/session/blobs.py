"""What Redis hands back, as the session store reads it: bytes, and stored messages as plain
data."""

from __future__ import annotations

from contracts.history import unpack

_unpack = unpack
"""Stored messages as plain data (``contracts.history.unpack``: one reader of the layout)."""


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
