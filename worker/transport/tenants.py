"""Whose message it is: the tenant of a delivery, from what RabbitMQ vouches for.

While tenancy is on (``LOOPWIRE_TENANTS__ENABLED``), every message a worker takes (a turn's
request, a cancel, a decision, a session's deletion or read, a step) belongs to a tenant:

- the one of its ``user_id``, which RabbitMQ refuses unless it is the publishing connection's
  own user: ``LOOPWIRE_TENANTS__USERS`` maps a user to its tenant, and a user not listed is
  the tenant of its own name;
- or, for a trusted user (the fleet's workers, the users in ``LOOPWIRE_TENANTS__TRUSTED``: the
  HTTP gateway), the tenant named in the ``x-loopwire-tenant`` header.

A message published through the intake exchange for one tenant (``<tenant>.turns``,
worker/transport/intake.py) must be that tenant's.

A message with no ``user_id``, an untrusted user naming another tenant than its own, a user
whose name is no tenant name, or a message in another tenant's intake is refused (``PermanentError``, code ``tenant_mismatch``: the
consumer dead-letters it with the reason) and never runs. With tenancy off every message is
taken as before, whatever its headers say, and ``of`` answers ``None``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from contracts import tenancy
from worker.errors import PermanentError


class Tenants:
    def __init__(
        self,
        *,
        enabled: bool = False,
        users: Mapping[str, str] | None = None,
        trusted: Collection[str] = (),
    ) -> None:
        self.enabled = enabled
        self.users = dict(users or {})
        self.trusted = frozenset(trusted)
        bad = sorted(t for t in self.users.values() if not tenancy.valid(t))
        if bad:
            raise ValueError(f"not a tenant name: {bad[0][:64]!r} (letters, digits, _ and -)")

    def of(
        self, sender: str | None, headers: Mapping[str, Any], lane: str | None = None
    ) -> str | None:
        """The tenant of a message from ``sender`` (its ``user_id``) with these headers,
        published for the tenant ``lane`` through the intake exchange (None: not)."""
        if not self.enabled:
            return None
        tenant = self._of(sender, headers)
        if lane is not None and lane != tenant:
            raise _refused(f"a message of tenant {tenant!r} in the intake of tenant {lane[:64]!r}")
        return tenant

    def _of(self, sender: str | None, headers: Mapping[str, Any]) -> str:
        named = headers.get(tenancy.H_TENANT)
        if isinstance(named, bytes):
            named = named.decode(errors="replace")
        if sender is None:
            raise _refused("the message has no user_id, so nothing vouches for its tenant")
        if sender in self.trusted:
            if named is None:
                return self._own(sender)
            if not isinstance(named, str) or not tenancy.valid(named):
                raise _refused(f"the {tenancy.H_TENANT} header {str(named)[:64]!r} is no tenant")
            return named
        own = self._own(sender)
        if named is not None and named != own:
            raise _refused(
                f"user {sender[:64]!r} acts for tenant {own!r} only, not {str(named)[:64]!r}"
            )
        return own

    def _own(self, sender: str) -> str:
        tenant = self.users.get(sender, sender)
        if not tenancy.valid(tenant):
            raise _refused(
                f"user {sender[:64]!r} is no tenant name; map it to one in LOOPWIRE_TENANTS__USERS"
            )
        return tenant


def _refused(reason: str) -> PermanentError:
    return PermanentError(f"tenant refused: {reason}", code="tenant_mismatch")
