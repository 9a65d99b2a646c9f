"""The process's small HTTP server: ``/livez``, ``/readyz`` and ``/metrics``.

``/livez`` answers while the event loop runs; ``/readyz`` answers 200 only when
every readiness check passes (consumer registered, Redis answers) and 503 with
the failing checks otherwise; ``/metrics`` serves the process's own registry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

Check = Callable[[], Awaitable[bool]]


class HealthServer:
    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        checks: Mapping[str, Check],
        port: int,
        host: str = "0.0.0.0",
    ) -> None:
        self.registry = registry
        self.checks = dict(checks)
        self.port = port
        self.host = host
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        app = web.Application()
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _livez(self, _: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, _: web.Request) -> web.Response:
        failing = []
        for name, check in self.checks.items():
            try:
                ok = await asyncio.wait_for(check(), timeout=2.0)
            except Exception:
                ok = False
            if not ok:
                failing.append(name)
        if failing:
            return web.Response(status=503, text="not ready: " + ", ".join(failing) + "\n")
        return web.Response(text="ready\n")

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
