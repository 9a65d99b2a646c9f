"""The ``file_note`` tool: file a note for the session, in Redis.

Notes are appended (msgpack, one list item each) to ``keys.session_notes``,
which shares the session's hash tag. The tool is *not* idempotent: filing the
same note twice files two notes, so a call interrupted by a dead instance is
answered ``unknown`` instead of being run again. The reply carries
``state_updates={"notes_count": n}`` so the session's state knows how many
notes it has. The value has no search result keys (``items``, ``results``, …):
filing a note says nothing to the loop's empty-streak guard.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from contracts import keys
from contracts.codec import encode_obj
from tool_services.sdk import CallContext, ToolError, ToolResult, ToolService

MAX_NOTES: Final = 1000

# Append unless the session already has MAX_NOTES notes; returns the new count or -1.
_APPEND: Final = """
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[2]) then return -1 end
return redis.call('RPUSH', KEYS[1], ARGV[1])
"""

DESCRIPTION = (
    "File a short note for this session (a decision, a fact to remember, a follow-up). "
    "Returns the note id and how many notes the session has. Filing the same text twice "
    "files two notes."
)


class FileNoteArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, max_length=4000, description="The note itself.")
    title: str | None = Field(default=None, max_length=200, description="An optional title.")
    tags: list[Annotated[str, StringConstraints(min_length=1, max_length=50)]] = Field(
        default_factory=list, max_length=10, description="Optional tags, e.g. ['billing']."
    )


async def file_note(args: FileNoteArgs, ctx: CallContext) -> ToolResult:
    note_id = uuid.uuid4().hex
    note = {
        "note_id": note_id,
        "title": args.title,
        "text": args.text,
        "tags": args.tags,
        "turn_id": ctx.turn_id,
        "agent": ctx.agent,
        "filed_at": time.time(),
    }
    append = ctx.redis.register_script(_APPEND)
    count = int(
        await append(keys=[keys.session_notes(ctx.session_id)], args=[encode_obj(note), MAX_NOTES])
    )
    if count < 0:
        raise ToolError(f"this session already has {MAX_NOTES} notes; no more can be filed")
    return ToolResult(
        value={"filed": True, "note_id": note_id, "count": count},
        state_updates={"notes_count": count},
    )


def create_service() -> ToolService:
    service = ToolService("notes")
    service.add_tool(file_note, description=DESCRIPTION, timeout_s=10, idempotent=False)
    return service
