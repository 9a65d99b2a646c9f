"""The ``file_note`` tool: file a note for the session, in Redis.

Notes are appended (msgpack, one list item each) to ``keys.session_notes``,
which shares the session's hash tag. The tool is *not* idempotent: filing the
same note twice files two notes, so a call interrupted by a dead instance is
answered ``unknown`` instead of being run again. Within one call the write is
safe to retry: the script remembers each call's idempotency key
(``keys.session_notes_filed``), so a write whose reply was lost to a Redis
pause or failover is tried again until the call's deadline and files its
note once, with an id derived from the key. The reply carries
``state_updates={"notes_count": n}`` so the session's state knows how many
notes it has. The value has no search result keys (``items``, ``results``, …):
filing a note says nothing to the loop's empty-streak guard.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from contracts import keys
from contracts.codec import encode_obj
from tool_services.sdk import CallContext, ToolError, ToolResult, ToolService

MAX_NOTES: Final = 1000
RETRY_S: Final = 0.5

log = logging.getLogger("loopwire.tool_services.notes")

# File the note of one call once: the count it made when the call's key was seen before;
# else append unless the session has MAX_NOTES notes (-1), and remember the count.
_APPEND: Final = """
local filed = redis.call('HGET', KEYS[2], ARGV[3])
if filed then return tonumber(filed) end
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[2]) then return -1 end
local count = redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[3], count)
return count
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
    # the note's id comes from the call's key: a retried write is recognised as the same note
    note_id = hashlib.sha256(ctx.idempotency_key.encode()).hexdigest()[:32]
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
    session_keys = [keys.session_notes(ctx.session_id), keys.session_notes_filed(ctx.session_id)]
    while True:
        try:
            count = int(
                await append(
                    keys=session_keys, args=[encode_obj(note), MAX_NOTES, ctx.idempotency_key]
                )
            )
            break
        except (RedisConnectionError, RedisTimeoutError):
            # Redis paused or failing over: the write may or may not have landed, and the
            # script files it at most once, so try again while the caller still waits
            if ctx.remaining_s() < 2 * RETRY_S:
                raise
            log.warning("notes store unavailable for call %s; retrying", ctx.call_id)
            await asyncio.sleep(RETRY_S)
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
