"""The ``lookup`` tool (``tests.bench.lookup``) as a tool service built with the SDK, for
loopwire in the ``long`` scenario: ``python -m tests.bench.lookup_service``, configured as
any tool service is (``LOOPWIRE_AMQP_URL``, ``LOOPWIRE_REDIS_URL``, ``LOOPWIRE_TOOLS__*``).
"""

from __future__ import annotations

import sys
from typing import Any

from tests.bench.lookup import DESCRIPTION, LookupArgs, lookup_result
from tool_services.sdk import CallContext, ToolService


async def lookup(args: LookupArgs, ctx: CallContext) -> dict[str, Any]:
    return lookup_result(args.query, args.size)


def create_service() -> ToolService:
    service = ToolService("bench-lookup")
    service.add_tool(lookup, description=DESCRIPTION, timeout_s=10, idempotent=True)
    return service


if __name__ == "__main__":
    from tool_services.runner import serve_service

    sys.exit(serve_service(create_service))
