"""The operator console, served by the HTTP gateway at ``/console`` (docs/console.md): the
tenant's turns live, a turn's timeline and tree, a session, the approvals inbox, the dead
letters, and the actions taken from it.

``index.py`` keeps the list of turns from the events (``feed.py`` takes them off the broker
and tells the open pages), ``pages.py`` reads, ``actions.py`` acts, ``viewer.py`` says who is
looking and for which tenant, ``timeline.py`` assembles a turn's steps.
"""

from __future__ import annotations

from pathlib import Path

from aio_pika.abc import AbstractRobustConnection
from redis.asyncio import Redis
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.console.actions import Actions
from gateway.console.feed import Feed, Hub
from gateway.console.index import Index
from gateway.console.pages import Pages
from gateway.http.fleet import Fleet
from gateway.http.keys import ApiKeys


class Console:
    def __init__(
        self,
        *,
        keys: ApiKeys,
        fleet: Fleet,
        redis: Redis,
        ttl_s: int,
        keep: int = 10_000,
        list_size: int = 1000,
        trace_url: str | None = None,
    ) -> None:
        self.hub = Hub()
        self.index = Index(redis, ttl_s=ttl_s, keep=keep)
        self.feed = Feed(self.index, self.hub)
        self.pages = Pages(
            keys=keys,
            fleet=fleet,
            index=self.index,
            hub=self.hub,
            list_size=list_size,
            trace_url=trace_url,
        )
        self.actions = Actions(self.pages)

    async def serve(self, connection: AbstractRobustConnection) -> None:
        await self.feed.serve(connection)

    def mount(self) -> Mount:
        p, a, s = self.pages, self.actions, self.pages.signed_in
        static = StaticFiles(directory=str(Path(__file__).parent / "static"))
        return Mount(
            "/console",
            routes=[
                Route("/", s(p.turns)),
                Route("/login", p.login, methods=["GET", "POST"]),
                Route("/logout", p.logout, methods=["POST"]),
                Route("/tenant", s(a.switch), methods=["POST"]),
                Route("/rows", s(p.rows)),
                Route("/live", s(p.live)),
                Route("/turns/{turn_id}", s(p.turn)),
                Route("/turns/{turn_id}/cancel", s(a.cancel), methods=["POST"]),
                Route("/sessions/{session_id}", s(p.session)),
                Route("/sessions/{session_id}/delete", s(a.delete_session), methods=["POST"]),
                Route("/approvals", s(p.approvals)),
                Route("/approvals/check", s(a.validate), methods=["POST"]),
                Route("/approvals/{turn_id}/{call_id}", s(a.decide), methods=["POST"]),
                Route("/dead-letters", s(p.dead_letters)),
                Route("/dead-letters/{letter_id}/replay", s(a.replay), methods=["POST"]),
                Route("/dead-letters/{letter_id}/purge", s(a.purge), methods=["POST"]),
                Route("/actions", s(p.actions)),
                Mount("/static", static, name="static"),
            ],
        )
