"""The gateway's connections: one publisher client per tenant it acts for (each a connection
of the gateway's broker user, which the workers trust to name the tenant), opened at the first
request of that tenant and kept; and one Redis client for the threads."""

from __future__ import annotations

import asyncio

from contracts.client import LoopwireClient
from contracts.runtime.tls import TlsFiles


class Fleet:
    def __init__(self, amqp_urls: tuple[str, ...], tls: TlsFiles | None) -> None:
        self.amqp_urls = amqp_urls
        self.tls = tls
        self._clients: dict[str | None, LoopwireClient] = {}
        self._lock = asyncio.Lock()

    async def client(self, tenant: str | None) -> LoopwireClient:
        found = self._clients.get(tenant)
        if found is not None:
            return found
        async with self._lock:
            if tenant not in self._clients:
                client = LoopwireClient(self.amqp_urls, tls=self.tls, tenant=tenant)
                await asyncio.wait_for(client.connect(), 15)
                self._clients[tenant] = client
            return self._clients[tenant]

    @property
    def connected(self) -> int:
        return len(self._clients)

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
