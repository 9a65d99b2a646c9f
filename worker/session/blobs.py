"""What Redis hands back, as the session store reads it: bytes, and stored messages as plain
data."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack


def _unpack(chunks: Sequence[bytes | str]) -> list[dict[str, Any]]:
    """Stored messages as plain data. Each chunk holds one or more whole messages; they are ours
    (validated when saved), so they are not validated again on every step."""
    out: list[dict[str, Any]] = []
    for chunk in chunks:
        data = _bytes(chunk)
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1))
        unpacker.feed(data)
        out.extend(unpacker)
    return out


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
