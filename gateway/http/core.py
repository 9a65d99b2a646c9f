"""What the gateway's routes share: the authenticated call, the JSON error, the request body
read within its limit, a thread looked up for the call's tenant."""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from contracts.base import SAFE_ID_PATTERN
from contracts.client import LoopwireClient
from gateway.http.errors import RunError
from gateway.http.keys import ApiKey
from gateway.http.metrics import GatewayMetrics
from gateway.http.threads import Threads
from gateway.http.webhooks import Webhooks

SAFE = re.compile(SAFE_ID_PATTERN)
"""A valid thread or run id (a session or turn id)."""


class Call:
    """One authenticated request: its key, its tenant's client, the threads."""

    def __init__(self, key: ApiKey, client: LoopwireClient, threads: Threads) -> None:
        self.key = key
        self.client = client
        self.threads = threads


class Routes:
    """The state every route reads (set by ``Gateway``)."""

    assistants: dict[str, dict[str, Any]]
    threads: Threads
    metrics: GatewayMetrics
    max_body_bytes: int
    wait_timeout_s: float
    webhooks: Webhooks | None

    async def _body(self, request: Request) -> dict[str, Any]:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise RunError(413, f"the body is larger than {self.max_body_bytes} bytes")
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            raise RunError(413, f"the body is larger than {self.max_body_bytes} bytes")
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise RunError(400, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RunError(422, "the body must be a JSON object")
        return body

    async def _thread(self, call: Call, thread_id: str) -> tuple[dict[str, Any], Any]:
        """The thread's record (made up from its session for a session without one) and its
        session's summary; 404 when neither exists."""
        record = await call.threads.get(thread_id)
        summary = await call.client.sessions.get(thread_id)
        if record is None:
            if summary is None:
                raise RunError(404, f"no thread {thread_id}")
            record = {"created_at": summary.created_at, "metadata": {}}
        return record, summary


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def page(body: dict[str, Any]) -> tuple[int, int]:
    limit, offset = body.get("limit", 10), body.get("offset", 0)
    if (
        not isinstance(limit, int)
        or not isinstance(offset, int)
        or not 1 <= limit <= 1000
        or offset < 0
    ):
        raise RunError(422, "limit is 1 to 1000 and offset at least 0")
    return limit, offset


def run_path(thread_id: str, run_id: str) -> str:
    return f"/threads/{thread_id}/runs/{run_id}"
