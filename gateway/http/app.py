"""The HTTP gateway's ASGI application (Starlette): the Agent Protocol's assistants, threads
and runs over loopwire's queue (docs/http.md).

Every route but ``/ok``, ``/readyz`` and ``/metrics`` needs an API key (``keys.py``); the
request then acts for the key's tenant (``contracts.tenancy``): its threads, runs and events
are that tenant's, and another tenant's thread answers 404, as one that does not exist. The
gateway keeps nothing of its own but the threads' records in Redis (``threads.py``), so any
replica answers any request, and a replica that dies mid-stream loses no run: the run is the
fleet's, and the client rejoins it (``/threads/{id}/runs/{run_id}/stream`` or ``/join``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import yaml
from aio_pika.abc import AbstractRobustConnection
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from contracts import tenancy
from contracts.client import TurnRejectedError
from contracts.events import Event
from contracts.runtime.amqp import connect
from contracts.session_client import SessionError
from gateway.console import Console
from gateway.http import runs, shapes, webhooks
from gateway.http.core import SAFE, Call, error
from gateway.http.errors import RunError
from gateway.http.fleet import Fleet
from gateway.http.keys import ApiKeys
from gateway.http.metrics import GatewayMetrics
from gateway.http.run_routes import RunRoutes
from gateway.http.thread_routes import ThreadRoutes
from gateway.http.threads import Threads
from gateway.http.webhooks import Webhooks

Handler = Callable[[Request, "Call"], Awaitable[Response]]


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The gateway's OpenAPI document (``openapi.yaml`` beside this module, committed)."""
    loaded: dict[str, Any] = yaml.safe_load((Path(__file__).parent / "openapi.yaml").read_text())
    return loaded


class Gateway(ThreadRoutes, RunRoutes):
    def __init__(
        self,
        *,
        fleet: Fleet,
        redis: Redis,
        keys: ApiKeys,
        assistants: Sequence[dict[str, Any]],
        ttl_s: int,
        max_body_bytes: int,
        wait_timeout_s: float,
        registry: CollectorRegistry | None = None,
        webhooks: Webhooks | None = None,
        console: Console | None = None,
    ) -> None:
        self.fleet = fleet
        self.console = console
        self.webhooks = webhooks
        self.redis = redis
        self.keys = keys
        self.assistants = {a["assistant_id"]: a for a in assistants}
        self.threads = Threads(redis, ttl_s)
        self.max_body_bytes = max_body_bytes
        self.wait_timeout_s = wait_timeout_s
        self.registry = registry or CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        if console is not None:
            console.pages.metrics = self.metrics

    # -- the application ----------------------------------------------------------------------

    def app(self) -> Starlette:
        a = self._authed
        routes: list[BaseRoute] = [
            Route("/ok", self.ok),
            Route("/readyz", self.readyz),
            Route("/metrics", self.prometheus),
            Route("/openapi.json", self.openapi),
            Route("/assistants/search", a(self.search_assistants), methods=["POST"]),
            Route("/assistants/{assistant_id}", a(self.get_assistant)),
            Route("/assistants/{assistant_id}/schemas", a(self.assistant_schemas)),
            Route("/threads", a(self.create_thread), methods=["POST"]),
            Route("/threads/search", a(self.search_threads), methods=["POST"]),
            Route("/threads/{thread_id}", a(self.get_thread)),
            Route("/threads/{thread_id}", a(self.delete_thread), methods=["DELETE"]),
            Route("/threads/{thread_id}/state", a(self.thread_state)),
            Route("/threads/{thread_id}/history", a(self.thread_history), methods=["GET", "POST"]),
            Route("/threads/{thread_id}/runs", a(self.create_run), methods=["POST"]),
            Route("/threads/{thread_id}/runs", a(self.list_runs)),
            Route("/threads/{thread_id}/runs/wait", a(self.wait_run), methods=["POST"]),
            Route("/threads/{thread_id}/runs/stream", a(self.stream_run), methods=["POST"]),
            Route("/runs/wait", a(self.wait_run), methods=["POST"]),
            Route("/runs/stream", a(self.stream_run), methods=["POST"]),
            Route("/threads/{thread_id}/runs/{run_id}", a(self.get_run)),
            Route(
                "/threads/{thread_id}/runs/{run_id}/cancel", a(self.cancel_run), methods=["POST"]
            ),
            Route("/threads/{thread_id}/runs/{run_id}/join", a(self.join_run)),
            Route("/threads/{thread_id}/runs/{run_id}/stream", a(self.rejoin_stream)),
        ]
        if self.console is not None:
            routes.append(self.console.mount())
        return Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """The webhooks' consumer (webhooks.py) and the console's feed (gateway.console.feed)
        run for as long as the application, on one connection of their own."""
        served: list[Callable[[AbstractRobustConnection], Coroutine[Any, Any, None]]] = []
        if self.webhooks is not None:
            served.append(functools.partial(self.webhooks.serve, payload=self._payload))
        if self.console is not None:
            served.append(self.console.serve)
        if not served:
            yield
            return
        connection = await connect(
            self.fleet.amqp_urls, name="loopwire-gateway-feeds", tls=self.fleet.tls
        )
        tasks = [asyncio.create_task(serve(connection)) for serve in served]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await connection.close()

    async def _payload(self, tenant: str | None, event: Event) -> dict[str, Any]:
        """A run's webhook body: the run as the protocol has it, and the thread's values."""
        thread_id = event.session_id or ""
        history = await runs.whole_history(self.redis, thread_id) if thread_id else []
        return {
            **shapes.run(
                event.turn_id or "",
                thread_id,
                event.agent,
                webhooks.ended(event),
                created_at=event.time,
            ),
            "values": shapes.values(history, thread_id),
        }

    def _authed(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            started = time.monotonic()
            route = request.scope.get("route")
            path = getattr(route, "path", None)
            if path is None:  # only then is the request's URL put together
                path = request.url.path
            response = await self._answer(request, handler)
            self.metrics.observe(request.method, path, response.status_code, started)
            return response

        return endpoint

    async def _answer(self, request: Request, handler: Handler) -> Response:
        presented = request.headers.get("x-api-key")
        authorization = request.headers.get("authorization", "")
        if presented is None and authorization.lower().startswith("bearer "):
            presented = authorization[7:].strip()
        key = self.keys.find(presented) if presented else None
        if key is None:
            return error(401, "a valid API key is required (x-api-key or Authorization: Bearer)")
        for name in ("thread_id", "run_id", "assistant_id"):
            value = request.path_params.get(name)
            if value is not None and name != "assistant_id" and not SAFE.fullmatch(value):
                return error(422, f"{name} {value[:100]!r} is not a valid id")
        try:
            with tenancy.acting_for(key.tenant):
                client = await self.fleet.client(key.tenant)
                return await handler(request, Call(key, client, self.threads))
        except RunError as exc:
            return error(exc.status, exc.message)
        except SessionError as exc:
            return error(404 if exc.code == "not_found" else 422, str(exc))
        except TurnRejectedError as exc:
            return error(422, f"the run was refused: {exc}")
        except TimeoutError:
            return error(504, "the fleet did not answer in time")

    # -- health ---------------------------------------------------------------------------------

    async def ok(self, request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def readyz(self, request: Request) -> Response:
        try:
            await self.redis.ping()
        except Exception as exc:
            return error(503, f"Redis does not answer: {type(exc).__name__}")
        if self.console is not None and not self.console.feed.ready.is_set():
            return error(503, "the console's feed is not bound to the events yet")
        return JSONResponse({"ok": True})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
