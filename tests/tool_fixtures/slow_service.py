"""A tool service with one slow, non-idempotent tool that records its executions in Redis.

Run as ``python -m tests.tool_fixtures.slow_service`` with:

- ``LW_TEST_SERVICE`` — the service name;
- ``LW_TEST_TOOL`` — the tool name (unique per test);
- ``LW_TEST_RECORD`` — a Redis list: ``start:<call_id>`` is pushed when the tool
  starts and ``end:<call_id>`` when it finishes;
- ``LW_TEST_SLEEP`` — how long the tool runs, in seconds.
"""

from __future__ import annotations

import asyncio
import os
import sys

from pydantic import BaseModel

from tool_services.runner import serve_service
from tool_services.sdk import CallContext, ToolService


class SlowArgs(BaseModel):
    label: str = ""


def create_service() -> ToolService:
    tool = os.environ["LW_TEST_TOOL"]
    record = os.environ["LW_TEST_RECORD"]
    seconds = float(os.environ.get("LW_TEST_SLEEP", "30"))
    service = ToolService(os.environ.get("LW_TEST_SERVICE", "slow"))

    @service.tool(name=tool, idempotent=False, timeout_s=120, description="Sleeps, then answers.")
    async def slow(args: SlowArgs, ctx: CallContext) -> dict[str, object]:
        await ctx.redis.rpush(record, f"start:{ctx.call_id}")
        await asyncio.sleep(seconds)
        await ctx.redis.rpush(record, f"end:{ctx.call_id}")
        return {"slept": seconds, "label": args.label}

    return service


if __name__ == "__main__":
    sys.exit(serve_service(create_service))
