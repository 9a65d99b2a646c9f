"""Tenants: whose work a process is doing, the one place that decides it for keys and routing.

A tenant is vouched for, not claimed (docs/tenants.md): the worker resolves it from the
broker-validated ``user_id`` of a delivery (``worker.transport.tenants``) and sets it for the
delivery's handling with ``acting_for``. Everything built while handling it follows:

- the Redis keys of a session and of a turn (``contracts.keys``): the tenant goes inside the
  hash tag, ``lw:{<tenant>/<session_id>}:state``, so a session id is unique within its tenant
  and one session's keys still share one slot on Redis Cluster; the tenant ``default`` keeps
  the keys it always had;
- the idempotency key of a tool call (``contracts.tools.idempotency_key``), so two tenants'
  calls with the same turn and call ids are two calls;
- the events' routing keys, which start with ``<tenant>.`` while tenancy is on, so that
  RabbitMQ's topic permissions keep a tenant's subscribers to its own events;
- the ``x-loopwire-tenant`` header of the work a worker publishes for the turn (its next
  step, a child turn, a delayed retry), which the next worker trusts because a worker sent it.

With tenancy off (the default) nothing is set: ``current()`` is ``None``, and keys, routing
keys and headers are exactly what they were before tenants existed. A tenant name is a safe
id (``contracts.base.SAFE_ID_PATTERN``), which has no ``/``, ``.``, ``{`` or ``}``: the
prefixed forms never collide with the default tenant's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Final

from contracts.base import SAFE_ID_PATTERN

DEFAULT: Final = "default"
"""The tenant of every turn while tenancy is off, and of a user mapped to no other one."""

H_TENANT: Final = "x-loopwire-tenant"
"""Header naming the tenant a trusted user (a worker, the HTTP gateway) acts for."""

_SAFE = re.compile(SAFE_ID_PATTERN)
_current: ContextVar[str | None] = ContextVar("loopwire_tenant", default=None)


def valid(tenant: str) -> bool:
    return bool(_SAFE.match(tenant))


def current() -> str | None:
    """The tenant whose work this task does; ``None`` while tenancy is off."""
    return _current.get()


@contextmanager
def acting_for(tenant: str | None) -> Iterator[None]:
    """Do the enclosed work for ``tenant`` (``None``: tenancy off)."""
    if tenant is not None and not valid(tenant):
        raise ValueError(f"not a tenant name: {tenant[:64]!r}")
    token = _current.set(tenant)
    try:
        yield
    finally:
        _current.reset(token)


def scoped(name: str) -> str:
    """``name`` (a session or turn id) within the current tenant: itself for the default
    tenant and with tenancy off, ``<tenant>/<name>`` for any other."""
    tenant = _current.get()
    return name if tenant is None or tenant == DEFAULT else f"{tenant}/{name}"


def routed(routing_key: str) -> str:
    """An event's routing key as published: ``<tenant>.<routing_key>`` while tenancy is on."""
    tenant = _current.get()
    return routing_key if tenant is None else f"{tenant}.{routing_key}"


def headers() -> dict[str, str]:
    """The header that carries the current tenant on the work a worker publishes."""
    tenant = _current.get()
    return {} if tenant is None else {H_TENANT: tenant}
