"""The console's pages (docs/console.md): server-rendered HTML (Jinja2, autoescaped), a little
script of our own (``static/console.js``) for the live parts, no build step.

Each page is one or a few reads any service could make: the console's index (``index.py``) for
the live list, session reads for a turn's steps, history and result and for a session, the
tenant's list of calls waiting for a decision (as ``loopwire approvals`` reads it), the
dead-letter queue (``contracts.dead_letters``, as ``loopwire dlq``). Actions are in
``actions.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.templating import Jinja2Templates

from contracts import keys as session_keys
from contracts import tenancy
from contracts.control import ApprovalRequest
from contracts.dead_letters import list_dead
from contracts.messages import ChatMessage
from contracts.session_client import SessionError
from gateway.console import timeline
from gateway.console.feed import Hub
from gateway.console.index import Index, Row
from gateway.console.viewer import KEY_COOKIE, Viewer, viewer
from gateway.http.core import SAFE
from gateway.http.fleet import Fleet
from gateway.http.keys import ApiKeys
from gateway.http.metrics import GatewayMetrics

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
STATUSES = ("queued", "running", "parked", "done", "rejected")
PING_S = 15.0

Page = Callable[[Request, Viewer], Awaitable[Response]]


def _when(value: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(value)) if value else ""


TEMPLATES.env.filters["when"] = _when
TEMPLATES.env.filters["pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True, default=str)


class Pages:
    def __init__(
        self,
        *,
        keys: ApiKeys,
        fleet: Fleet,
        index: Index,
        hub: Hub,
        list_size: int,
        trace_url: str | None,
    ) -> None:
        self.keys = keys
        self.fleet = fleet
        self.index = index
        self.hub = hub
        self.list_size = list_size
        self.trace_url = trace_url
        self.metrics: GatewayMetrics | None = None
        """The gateway's metrics (set by ``gateway.http.app.Gateway``): the console's requests
        and its open live feeds count with the API's."""

    def signed_in(self, page: Page) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            started = time.monotonic()
            response = await self._answer(request, page)
            if self.metrics is not None:
                path = getattr(request.scope.get("route"), "path", "")
                self.metrics.observe(
                    request.method, f"/console{path}", response.status_code, started
                )
            return response

        return endpoint

    async def _answer(self, request: Request, page: Page) -> Response:
        seen = viewer(request, self.keys)
        if seen is None:
            if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
                return RedirectResponse("/console/login", status_code=303)
            return Response("a valid API key is required", status_code=401)
        for name in ("turn_id", "session_id"):
            value = request.path_params.get(name)
            if value is not None and not SAFE.fullmatch(value):
                return Response(f"{name} is not a valid id", status_code=422)
        with tenancy.acting_for(seen.acting_for):
            return await page(request, seen)

    async def render(
        self,
        request: Request,
        seen: Viewer | None,
        name: str,
        *,
        status: int = 200,
        **context: object,
    ) -> Response:
        tenants = await self.index.tenants() if seen is not None and seen.key.admin else []
        return TEMPLATES.TemplateResponse(
            request,
            name,
            {
                "viewer": seen,
                "tenants": tenants,
                "trace_url": self.trace_url,
                "flash": _flash(request),
                **context,
            },
            status_code=status,
        )

    # -- signing in ---------------------------------------------------------------------------

    async def login(self, request: Request) -> Response:
        if request.method == "GET":
            return await self.render(request, None, "login.html")
        form = await request.form()
        presented = str(form.get("key") or "")
        if self.keys.find(presented) is None:
            return await self.render(
                request, None, "login.html", status=401, error="That key is not valid."
            )
        response = RedirectResponse("/console", status_code=303)
        response.set_cookie(
            KEY_COOKIE,
            presented,
            httponly=True,
            samesite="strict",
            path="/console",
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(self, request: Request) -> Response:
        response = RedirectResponse("/console/login", status_code=303)
        response.delete_cookie(KEY_COOKIE, path="/console")
        return response

    # -- the live list --------------------------------------------------------------------------

    async def turns(self, request: Request, seen: Viewer) -> Response:
        read_at = time.time()  # the page's script asks for what changed since (``rows``)
        rows = await self.index.rows(seen.tenant, self.list_size)
        wanted = {k: request.query_params.get(k, "") for k in ("agent", "status", "session")}
        counts = Counter(r.status for r in rows)
        shown = [r for r in rows if _matches(r, wanted)]
        return await self.render(
            request,
            seen,
            "turns.html",
            rows=shown,
            counts=counts,
            statuses=STATUSES,
            agents=sorted({r.agent for r in rows}),
            wanted=wanted,
            read_at=read_at,
        )

    async def rows(self, request: Request, seen: Viewer) -> Response:
        """The list as JSON (what the page's script and programs read); ``?since=<time>``: the
        rows changed since (the list's script asks, once its live feed is open, for what
        changed between the page's read and the feed's start)."""
        try:
            since = float(request.query_params.get("since", "0"))
        except ValueError:
            return Response("since is a time in seconds", status_code=422)
        rows = [
            r for r in await self.index.rows(seen.tenant, self.list_size) if r.updated_at >= since
        ]
        return Response(json.dumps([r.public() for r in rows]), media_type="application/json")

    async def live(self, request: Request, seen: Viewer) -> Response:
        """Server-sent events: each change of the tenant's turns (``?turn=``: one turn's and its
        children's, with its streamed text)."""
        turn_id = request.query_params.get("turn") or None

        async def changes() -> AsyncIterator[dict[str, str]]:
            with self.hub.page(seen.tenant, turn_id) as queue, self._counted():
                yield {"event": "ready", "data": "{}"}
                while True:
                    try:
                        change = await asyncio.wait_for(queue.get(), PING_S)
                    except TimeoutError:
                        yield {"event": "ping", "data": "{}"}
                        continue
                    yield {"event": change["kind"], "data": json.dumps(change, default=str)}

        return EventSourceResponse(changes())

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        if self.metrics is not None:
            self.metrics.streams.inc()
        try:
            yield
        finally:
            if self.metrics is not None:
                self.metrics.streams.dec()

    # -- a turn ---------------------------------------------------------------------------------

    async def turn(self, request: Request, seen: Viewer) -> Response:
        turn_id = request.path_params["turn_id"]
        fragment = request.query_params.get("fragment") == "1"
        row = await self.index.row(seen.tenant, turn_id)
        client = await self.fleet.client(seen.acting_for)
        session_id = row.session_id if row is not None and row.session_id else None
        info = await client.sessions.turn(turn_id, session_id)
        if row is None and info is None:
            return await self.render(
                request, seen, "missing.html", status=404, what=f"turn {turn_id}"
            )
        result = await client.sessions.result(turn_id, session_id)
        if session_id is None and result is not None:
            session_id = result.session_id
        expired = False
        try:
            records = await client.sessions.steps(turn_id, session_id, limit=1000)
        except SessionError:
            records, expired = [], info is not None
        messages: list[ChatMessage] = []
        if session_id is not None and await client.sessions.get(session_id) is not None:
            messages, _ = await client.sessions.history(session_id, limit=1000, newest_first=True)
        events = await self.index.events(seen.tenant, turn_id)
        view = timeline.build(records, messages, events, result, expired=expired)
        name = "timeline.html" if fragment else "turn.html"
        return await self.render(
            request,
            seen,
            name,
            turn_id=turn_id,
            row=row,
            info=info,
            session_id=session_id,
            view=view,
        )

    # -- a session ------------------------------------------------------------------------------

    async def session(self, request: Request, seen: Viewer) -> Response:
        session_id = request.path_params["session_id"]
        client = await self.fleet.client(seen.acting_for)
        summary = await client.sessions.get(session_id)
        if summary is None:
            return await self.render(
                request, seen, "missing.html", status=404, what=f"session {session_id}"
            )
        turns = await client.sessions.turns(session_id)
        messages, total = await client.sessions.history(session_id, limit=200, newest_first=True)
        return await self.render(
            request,
            seen,
            "session.html",
            summary=summary,
            turns=turns,
            messages=list(reversed(messages)),
            total=total,
        )

    # -- approvals ------------------------------------------------------------------------------

    async def approvals(self, request: Request, seen: Viewer) -> Response:
        return await self.render(request, seen, "approvals.html", waiting=await self.waiting())

    async def waiting(self) -> list[ApprovalRequest]:
        """The tenant's calls waiting for a decision, oldest first (the caller acts for it)."""
        redis = self.index.redis
        found = [
            ApprovalRequest.model_validate_json(value)
            async for _, value in redis.hscan_iter(session_keys.approvals_waiting())
        ]
        return sorted(found, key=lambda a: a.since)

    # -- dead letters ---------------------------------------------------------------------------

    async def dead_letters(self, request: Request, seen: Viewer) -> Response:
        letters = await list_dead(
            self.fleet.amqp_urls[0], self.fleet.tls, seen.letters_of, full=True
        )
        by_reason = Counter(letter.code for letter in letters)
        return await self.render(
            request,
            seen,
            "dead_letters.html",
            letters=letters,
            by_reason=sorted(by_reason.items()),
            actions=[
                a
                for a in await self.index.actions(seen.tenant)
                if a["action"].startswith("dead-letter")
            ][:20],
        )

    async def actions(self, request: Request, seen: Viewer) -> Response:
        return await self.render(
            request, seen, "actions.html", actions=await self.index.actions(seen.tenant)
        )


def _matches(row: Row, wanted: dict[str, str]) -> bool:
    return (
        (not wanted["agent"] or row.agent == wanted["agent"])
        and (not wanted["status"] or row.status == wanted["status"])
        and (not wanted["session"] or row.session_id == wanted["session"])
    )


def _flash(request: Request) -> dict[str, str]:
    """A message an action left for the page it went back to (``?said=``, ``?error=``)."""
    return {
        "said": request.query_params.get("said", "")[:500],
        "error": request.query_params.get("error", "")[:500],
    }
