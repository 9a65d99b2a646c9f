"""Runs: started, waited for, streamed, listed, cancelled, joined and rejoined (``runs.py``
does the work; here, the routes' requests and answers)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from contracts import tenancy
from contracts.client import new_id
from contracts.messages import ChatMessage
from gateway.http import approvals, runs, shapes
from gateway.http.core import Call, Routes, error, run_path
from gateway.http.errors import RunError
from gateway.http.keys import ApiKey
from gateway.http.streams import Cursor, RunStream, Sent, follow


class RunRoutes(Routes):
    # -- runs -----------------------------------------------------------------------------------

    async def _start(self, request: Request, call: Call) -> runs.Following:
        """A new run's turn published, or (``command.resume``) the thread's run waiting for
        decisions decided; followed from before either."""
        body = await self._body(request)
        thread_id = request.path_params.get("thread_id")
        if thread_id is None:  # a thread-less run: a session of its own
            thread_id = str(uuid.uuid4())
        elif await call.threads.get(thread_id) is None:
            if body.get("if_not_exists") == "create":
                await call.threads.create(thread_id, {})
            elif await call.client.sessions.get(thread_id) is None:
                raise RunError(404, f"no thread {thread_id}")
        hook = await self._webhook(body)
        command = body.get("command")
        if command is not None:
            if not isinstance(command, dict) or "resume" not in command:
                raise RunError(422, 'a command is {"resume": ...} (the decisions of a run)')
            redis = call.threads.redis
            return await runs.resumed(
                call.client, redis, thread_id, command["resume"], call.key.name, before=hook
            )
        turn_id = new_id()
        if hook is not None:
            await hook(turn_id)
        started = runs.start(call.client, thread_id, body, list(self.assistants), turn_id)
        if request.path_params.get("thread_id") is None:  # a thread-less run has no record
            handle = await started
        else:  # the thread's record touched while the turn is published
            handle, _ = await asyncio.gather(started, call.threads.touch(thread_id))
        return runs.Following.of(handle, str(body["assistant_id"]))

    async def _webhook(self, body: dict[str, Any]) -> Callable[[str], Awaitable[None]] | None:
        """What registers the run's webhook, once its destination is checked (webhooks.py)."""
        url = body.get("webhook")
        if url is None:
            return None
        if self.webhooks is None:
            raise RunError(422, "webhooks are not configured (LOOPWIRE_GATEWAY__WEBHOOK_SECRET)")
        if not isinstance(url, str) or len(url) > 2000:
            raise RunError(422, "webhook is a URL")
        await self.webhooks.destinations.check(url)
        webhooks = self.webhooks

        async def register(run_id: str) -> None:
            await webhooks.register(run_id, url)

        return register

    async def create_run(self, request: Request, call: Call) -> Response:
        run = await self._start(request, call)
        await run.close()  # the run goes on in the fleet; the client asks for it by id
        body = shapes.run(
            run.run_id, run.thread_id, run.assistant_id, "pending", created_at=time.time()
        )
        return JSONResponse(body, headers={"Content-Location": run_path(run.thread_id, run.run_id)})

    async def wait_run(self, request: Request, call: Call) -> Response:
        run = await self._start(request, call)
        try:
            values = await self._waited(call, run)
        except BaseException:
            await run.close()
            raise
        # answered first; the run is let go of (its binding removed) after the response is sent
        return JSONResponse(values, background=BackgroundTask(run.close))

    async def _waited(self, call: Call, run: runs.Following) -> dict[str, Any]:
        """The thread's values once the run ends, or is interrupted (with what waits). A run
        this request published is answered as soon as its result reaches the reply queue; its
        events are watched meanwhile for an interrupt. The run's final event is announced
        after its last save, so the thread's messages are read as soon as it arrives, while
        the result is on its way (they are read after the result when it comes first)."""
        redis = call.threads.redis
        reading: list[asyncio.Task[list[ChatMessage]]] = []

        async def interrupted() -> list[dict[str, Any]] | None:
            async for event in run.events:
                if event.type == "approval.requested":
                    calls = await approvals.waiting(redis, run.run_id)
                    if calls:
                        return approvals.interrupts(calls)
                if event.type in runs.FINAL_EVENTS:
                    reading.append(asyncio.create_task(runs.whole_history(redis, run.thread_id)))
                    return None
            return None

        try:
            async with asyncio.timeout(self.wait_timeout_s):
                watching = asyncio.ensure_future(interrupted())
                answering = asyncio.ensure_future(run.result()) if run.answered_directly else None
                try:
                    pending = {watching} if answering is None else {watching, answering}
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    if watching in done and (waiting := watching.result()) is not None:
                        values = await self._values(call, run.thread_id, None)
                        values["__interrupt__"] = waiting
                        return values
                    result = await (answering if answering is not None else run.result())
                finally:
                    for task in (watching, answering):
                        if task is not None and not task.done():
                            task.cancel()
                return await self._values(call, run.thread_id, result, *reading)
        finally:
            for read in reading:  # not awaited when the run was refused or timed out
                if not read.done():
                    read.cancel()
                elif not read.cancelled():
                    read.exception()

    async def _values(
        self,
        call: Call,
        thread_id: str,
        result: Any,
        read: Awaitable[list[ChatMessage]] | None = None,
    ) -> dict[str, Any]:
        """The thread's values (its messages, ``read`` already when given), with the run's
        error when it failed."""
        if read is None:
            read = runs.whole_history(call.threads.redis, thread_id)
        values = shapes.values(await read, thread_id)
        if result is not None and result.finish_reason == "error" and result.error is not None:
            values["__error__"] = {"error": result.error.code, "message": result.error.message}
        return values

    async def stream_run(self, request: Request, call: Call) -> Response:
        body = await self._body(request)
        modes = runs.stream_modes(body.get("stream_mode"))
        thread_id = request.path_params.get("thread_id")
        known = 0
        if thread_id is not None and await call.client.sessions.get(thread_id) is not None:
            _, known = await call.client.sessions.history(thread_id, limit=1)
        run = await self._start(request, call)
        stream = RunStream(call.client, run.thread_id, run.run_id, modes, call.threads.redis)
        stream.known = known

        async def events() -> AsyncIterator[Sent]:
            metadata = {"run_id": run.run_id, "thread_id": run.thread_id}
            yield "metadata", metadata, str(Cursor(known=known))
            async for sent in follow(stream, run.events, run.result):
                yield sent

        return self._sse(call.key, events(), run.thread_id, run.run_id, close=run.close)

    def _sse(
        self,
        key: ApiKey,
        events: AsyncIterator[Sent],
        thread_id: str,
        run_id: str,
        *,
        close: Callable[[], Awaitable[None]] | None = None,
    ) -> Response:
        metrics = self.metrics

        async def sent() -> AsyncIterator[ServerSentEvent]:
            metrics.streams.inc()
            try:
                with tenancy.acting_for(key.tenant):  # the body is sent after the endpoint
                    async for event, data, at in events:
                        yield ServerSentEvent(data=json.dumps(data), event=event, id=at)
            finally:
                metrics.streams.dec()
                if close is not None:
                    with contextlib.suppress(Exception):
                        await close()

        return EventSourceResponse(
            sent(), headers={"Location": f"{run_path(thread_id, run_id)}/stream"}, ping=15
        )

    async def list_runs(self, request: Request, call: Call) -> Response:
        thread_id = request.path_params["thread_id"]
        _, summary = await self._thread(call, thread_id)
        if summary is None:
            return JSONResponse([])
        turns = await call.client.sessions.turns(thread_id)
        return JSONResponse(
            [
                shapes.run(
                    t.turn_id,
                    thread_id,
                    summary.agent,
                    shapes.run_status(t),
                    created_at=summary.updated_at,
                )
                for t in reversed(turns)
            ]
        )

    async def get_run(self, request: Request, call: Call) -> Response:
        thread_id, run_id = request.path_params["thread_id"], request.path_params["run_id"]
        summary = await call.client.sessions.get(thread_id)
        info = await call.client.sessions.turn(run_id, thread_id)
        if summary is None or info is None:
            return error(404, f"no run {run_id} in thread {thread_id}")
        result = (
            await call.client.sessions.result(run_id, thread_id) if info.status == "done" else None
        )
        status = shapes.run_status(info, result)
        if info.status == "waiting" and await approvals.waiting(call.threads.redis, run_id):
            status = "interrupted"
        return JSONResponse(
            shapes.run(run_id, thread_id, summary.agent, status, created_at=summary.updated_at)
        )

    async def cancel_run(self, request: Request, call: Call) -> Response:
        thread_id, run_id = request.path_params["thread_id"], request.path_params["run_id"]
        action = request.query_params.get("action", "interrupt")
        if action not in ("interrupt", "rollback"):
            raise RunError(422, f"cancel action {action!r} is not one of interrupt, rollback")
        if await call.client.sessions.turn(run_id, thread_id) is None:
            return error(404, f"no run {run_id} in thread {thread_id}")
        await call.client.cancel(
            run_id,
            "cancelled over HTTP",
            session_id=thread_id,
            by=call.key.name,
            rollback=action == "rollback",
        )
        if request.query_params.get("wait") in ("1", "true"):
            await runs.follow(call.client, thread_id, run_id, self.wait_timeout_s)
        return JSONResponse(None, status_code=202)

    async def join_run(self, request: Request, call: Call) -> Response:
        thread_id, run_id = request.path_params["thread_id"], request.path_params["run_id"]
        result = await runs.follow(call.client, thread_id, run_id, self.wait_timeout_s)
        if result is None:
            return error(404, f"no run {run_id} in thread {thread_id}")
        return JSONResponse(await self._values(call, thread_id, result))

    async def rejoin_stream(self, request: Request, call: Call) -> Response:
        """A run's stream again (``Last-Event-ID``: from where the client was; none: from
        now), on any replica (streams.py)."""
        thread_id, run_id = request.path_params["thread_id"], request.path_params["run_id"]
        modes = runs.stream_modes(request.query_params.getlist("stream_mode") or None)
        cursor = Cursor.parse(request.headers.get("last-event-id"))
        client, timeout = call.client, self.wait_timeout_s
        if await client.sessions.turn(run_id, thread_id) is None:
            return error(404, f"no run {run_id} in thread {thread_id}")

        async def events() -> AsyncIterator[Sent]:
            if cursor is not None and cursor.ended:
                return
            async with runs.subscribed(client, run_id) as live:
                stream = RunStream(client, thread_id, run_id, modes, call.threads.redis)
                if cursor is None:  # from now on
                    _, stream.known = await client.sessions.history(thread_id, limit=1)
                else:
                    for sent in await stream.catch_up(cursor):
                        yield sent
                result = await client.sessions.result(run_id, thread_id)
                if result is not None:
                    for sent in await stream.ending(result):
                        yield sent
                    return
                waits = await stream.interrupt()  # it waits for decisions: said, and ended
                for sent in waits:
                    yield sent
                if waits:
                    return
                async with asyncio.timeout(timeout):
                    ended = lambda: client.sessions.result(run_id, thread_id)  # noqa: E731
                    async for sent in follow(stream, live, ended):
                        yield sent

        return self._sse(call.key, events(), thread_id, run_id)
