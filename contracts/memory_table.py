"""The memory service's table, as the workers also use it: a session's deletion forgets the
session's memories (``tool_services.memory.store`` owns the schema)."""

from __future__ import annotations

from typing import Final

TABLE: Final = "lw_memories"
FORGET_SESSION: Final = f"DELETE FROM {TABLE} WHERE scope = 'session' AND owner = $1"
"""Forget every memory of one session (``$1``: its id); the table may not exist yet."""
