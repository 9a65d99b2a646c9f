"""Webhooks: a run created with ``webhook`` gets one POST when it ends, signed per the
Standard Webhooks specification (the ``standardwebhooks`` package: ``webhook-id`` is the run
id, stable across retries, for the receiver to drop duplicates; ``webhook-timestamp``;
``webhook-signature``, HMAC-SHA256 with ``LOOPWIRE_GATEWAY__WEBHOOK_SECRET``).

- Registered before the run's turn is published (``lw:webhook:<run>``, with the session's
  expiry), so no end can come before it.
- Delivered by whichever replica takes the run's end from the gateways' shared queue
  (``loopwire.gateway.webhooks``, bound to every turn's end on ``loopwire.events``): at least
  once. The delivery is acked only once the POST was answered 2xx (the registration is then
  deleted, so a redelivered end sends nothing more) or it failed ``webhook_attempts`` times,
  with a delay doubling from 1 s to 60 s between attempts; a replica that dies meanwhile leaves
  the end to another.
- Destinations: ``http`` or ``https`` only, and never a private, loopback, link-local or
  otherwise reserved address (checked when the run is created and again before every attempt,
  on the addresses the name resolves to), unless the host or its network is in
  ``LOOPWIRE_GATEWAY__WEBHOOK_ALLOW``: a tenant cannot make the gateway call the internal
  network.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from redis.asyncio import Redis
from standardwebhooks.webhooks import Webhook

from contracts import keys, tenancy
from contracts import topology as t
from contracts.codec import DecodeError, decode
from contracts.events import Event
from gateway.http.errors import RunError

log = logging.getLogger("loopwire.gateway.webhooks")

ENDS = ("turn.completed", "turn.failed", "turn.cancelled")
STATUS = {"turn.completed": "success", "turn.failed": "error", "turn.cancelled": "interrupted"}
Payload = Callable[[str | None, Event], Awaitable[dict[str, Any]]]
"""The body of a run's webhook, from its tenant and its end."""


class Destinations:
    def __init__(self, allow: Sequence[str]) -> None:
        self.hosts = {a.lower() for a in allow if not _network(a)}
        self.networks = [n for a in allow if (n := _network(a)) is not None]

    async def check(self, url: str) -> None:
        """``RunError`` (422) when the gateway may not post to ``url``."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RunError(422, "a webhook is an http:// or https:// URL")
        host = parts.hostname.lower()
        if host in self.hosts:
            return
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, parts.port or 443)
        except OSError:
            raise RunError(422, f"the webhook's host {host[:100]!r} does not resolve") from None
        for info in infos:
            address = ipaddress.ip_address(info[4][0])
            if _internal(address) and not any(address in n for n in self.networks):
                raise RunError(
                    422,
                    f"the webhook's host {host[:100]!r} is an internal address ({address}); "
                    "allow it in LOOPWIRE_GATEWAY__WEBHOOK_ALLOW",
                )


def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        return None


def _internal(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return not address.is_global or address.is_multicast


class Webhooks:
    def __init__(
        self,
        redis: Redis,
        *,
        secret: str,
        allow: Sequence[str],
        ttl_s: int,
        attempts: int,
        timeout_s: float,
    ) -> None:
        self.redis = redis
        self.signer = Webhook(secret)
        self.destinations = Destinations(allow)
        self.ttl_s = ttl_s
        self.attempts = attempts
        self.timeout_s = timeout_s
        self.delivered = 0

    async def register(self, run_id: str, url: str) -> None:
        """Within the call's tenant; after ``destinations.check``."""
        await self.redis.set(keys.turn_webhook(run_id), url, ex=self.ttl_s)

    async def serve(self, connection: AbstractRobustConnection, payload: Payload) -> None:
        """Take runs' ends from the gateways' queue and deliver their webhooks, until
        cancelled."""
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=16)
        queue = await channel.declare_queue(
            t.GATEWAY_WEBHOOKS_QUEUE, durable=True, arguments={"x-queue-type": "quorum"}
        )
        for end in ENDS:
            await queue.bind(t.EVENTS_EXCHANGE, routing_key=f"#.{end}.#")
        async with aiohttp.ClientSession() as http:

            async def on_end(message: AbstractIncomingMessage) -> None:
                await self._on_end(message, http, payload)

            await queue.consume(on_end)
            await asyncio.Future()  # until cancelled

    async def _on_end(
        self, message: AbstractIncomingMessage, http: aiohttp.ClientSession, payload: Payload
    ) -> None:
        try:
            event = decode(message.body, Event)
        except DecodeError:
            await message.ack()
            return
        words = (message.routing_key or "").split(".")
        tenant = words[0] if len(words) == 5 else None
        with tenancy.acting_for(tenant):
            key = keys.turn_webhook(event.turn_id or "_")
            url = await self.redis.get(key)
            if url is not None:
                url = url.decode() if isinstance(url, bytes) else str(url)
                body = json.dumps(await payload(tenant, event)).encode()
                if await self._deliver(http, url, event.turn_id or "", body):
                    await self.redis.delete(key)
        await message.ack()

    async def _deliver(
        self, http: aiohttp.ClientSession, url: str, run_id: str, body: bytes
    ) -> bool:
        delay = 1.0
        for attempt in range(1, self.attempts + 1):
            try:
                await self.destinations.check(url)
                now = datetime.now(UTC)
                headers = {
                    "content-type": "application/json",
                    "webhook-id": run_id,
                    "webhook-timestamp": str(int(now.timestamp())),
                    "webhook-signature": self.signer.sign(run_id, now, body),
                }
                timeout = aiohttp.ClientTimeout(total=self.timeout_s)
                async with http.post(url, data=body, headers=headers, timeout=timeout) as answer:
                    if 200 <= answer.status < 300:
                        self.delivered += 1
                        return True
                    why = f"answered {answer.status}"
            except RunError as exc:
                log.warning("webhook of run %s not sent: %s", run_id, exc.message)
                return False
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            log.info("webhook of run %s, attempt %d: %s", run_id, attempt, why)
            if attempt < self.attempts:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)
        log.warning("webhook of run %s dropped after %d attempts", run_id, self.attempts)
        return False


def ended(event: Event) -> str:
    return STATUS.get(event.type, "error")
