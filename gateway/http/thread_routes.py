"""Assistants and threads: the agents file's agents and workflows, and sessions as threads
(their records in Redis, ``threads.py``; their state from the session's history)."""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from contracts.sessions import SessionSummary
from gateway.http import approvals, runs, shapes
from gateway.http.core import SAFE, Call, Routes, error, page
from gateway.http.errors import RunError


class ThreadRoutes(Routes):
    # -- assistants -----------------------------------------------------------------------------

    async def search_assistants(self, request: Request, call: Call) -> Response:
        body = await self._body(request)
        limit, offset = page(body)
        found = [
            a
            for a in self.assistants.values()
            if body.get("graph_id") in (None, a["graph_id"])
            and all(a["metadata"].get(k) == v for k, v in (body.get("metadata") or {}).items())
        ]
        return JSONResponse(found[offset : offset + limit])

    async def assistant_schemas(self, request: Request, call: Call) -> Response:
        """Its input schema (the user's messages) and its output schema (an agent's structured
        answer, when it has one)."""
        found = self.assistants.get(request.path_params["assistant_id"])
        if found is None:
            return error(404, f"no assistant {request.path_params['assistant_id'][:100]!r}")
        return JSONResponse(
            {
                "graph_id": found["graph_id"],
                "input_schema": found.get("input_schema"),
                "output_schema": found.get("output_schema"),
                "state_schema": None,
                "config_schema": None,
                "context_schema": None,
            }
        )

    async def get_assistant(self, request: Request, call: Call) -> Response:
        found = self.assistants.get(request.path_params["assistant_id"])
        if found is None:
            return error(404, f"no assistant {request.path_params['assistant_id'][:100]!r}")
        return JSONResponse(found)

    # -- threads --------------------------------------------------------------------------------

    async def create_thread(self, request: Request, call: Call) -> Response:
        body = await self._body(request)
        thread_id = body.get("thread_id") or str(uuid.uuid4())
        if not isinstance(thread_id, str) or not SAFE.fullmatch(thread_id):
            raise RunError(422, f"thread_id {str(thread_id)[:100]!r} is not a valid id")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise RunError(422, "metadata must be an object")
        record = await call.threads.create(thread_id, metadata)
        if record is None:
            if body.get("if_exists") == "do_nothing":
                return await self.get_thread_by_id(call, thread_id)
            raise RunError(409, f"thread {thread_id} exists")
        return JSONResponse(shapes.thread(thread_id, **record, summary=None))

    async def get_thread(self, request: Request, call: Call) -> Response:
        return await self.get_thread_by_id(call, request.path_params["thread_id"])

    async def get_thread_by_id(self, call: Call, thread_id: str) -> Response:
        record, summary = await self._thread(call, thread_id)
        state = None
        if summary is not None:
            state = shapes.values(
                await runs.whole_history(call.threads.redis, thread_id), thread_id
            )
        waiting = await self._interrupts(call, summary)
        return JSONResponse(
            shapes.thread(thread_id, **record, summary=summary, state=state, interrupts=waiting)
        )

    async def _interrupts(self, call: Call, summary: SessionSummary | None) -> list[dict[str, Any]]:
        """The calls the thread's run waits on a decision for, as the protocol's interrupts."""
        if summary is None or summary.running is None or not summary.parked:
            return []
        return approvals.interrupts(await approvals.waiting(call.threads.redis, summary.running))

    async def search_threads(self, request: Request, call: Call) -> Response:
        body = await self._body(request)
        limit, offset = page(body)
        found = await call.threads.search(body.get("metadata") or {}, limit, offset)
        summaries = [await call.client.sessions.get(thread_id) for thread_id, _ in found]
        return JSONResponse(
            [
                shapes.thread(thread_id, **record, summary=summary)
                for (thread_id, record), summary in zip(found, summaries, strict=True)
            ]
        )

    async def delete_thread(self, request: Request, call: Call) -> Response:
        thread_id = request.path_params["thread_id"]
        await self._thread(call, thread_id)
        if await call.client.sessions.get(thread_id) is not None:
            await call.client.sessions.delete(thread_id, reason="thread deleted", by=call.key.name)
        await call.threads.forget(thread_id)
        return Response(status_code=204)

    async def thread_state(self, request: Request, call: Call) -> Response:
        thread_id = request.path_params["thread_id"]
        record, summary = await self._thread(call, thread_id)
        history = await runs.whole_history(call.threads.redis, thread_id) if summary else []
        waiting = await self._interrupts(call, summary)
        tasks = [
            {"id": summary.running, "name": shapes.GRAPH_NODE, "interrupts": waiting}
        ] if waiting else []  # fmt: skip
        return JSONResponse(
            {
                "values": shapes.values(history, thread_id),
                "next": [shapes.GRAPH_NODE] if waiting else [],
                "tasks": tasks,
                "interrupts": waiting,
                "metadata": record["metadata"],
                "created_at": shapes.iso(summary.updated_at if summary else record["created_at"]),
                "checkpoint": {"thread_id": thread_id, "checkpoint_ns": "", "checkpoint_id": None},
                "parent_checkpoint": None,
            }
        )

    async def thread_history(self, request: Request, call: Call) -> Response:
        """One state, the current one: loopwire keeps the history, not checkpoints."""
        state = await self.thread_state(request, call)
        return Response(b"[" + state.body + b"]", media_type="application/json")
