"""Who looks at the console, and for which tenant.

A person signs in with an API key of the gateway's keys file (``gateway.http.keys``); the
console keeps it in a cookie (``HttpOnly``, ``SameSite=Strict``, path ``/console``, ``Secure``
when the request came over HTTPS), so that the browser's own requests (pages, forms, the live
feed's ``EventSource``, which cannot set headers) carry it, and no other site's page can make
the browser act with it. A program may send the key in ``x-api-key`` instead, as on the API.

A key sees its tenant only. A key marked ``"admin": true`` in the keys file sees every tenant
the console's index has seen and switches between them (the ``lw_console_tenant`` cookie);
its actions act for the tenant shown, as the gateway's trusted broker user may.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from contracts import tenancy
from gateway.http.keys import ApiKey, ApiKeys

KEY_COOKIE = "lw_console"
TENANT_COOKIE = "lw_console_tenant"


@dataclass(frozen=True, slots=True)
class Viewer:
    key: ApiKey
    tenant: str
    """The tenant shown (the index's name for it: ``default`` while tenancy is off)."""

    @property
    def acting_for(self) -> str | None:
        """The tenant the fleet's clients act for: ``None`` for the fleet-wide default one."""
        return None if self.tenant == tenancy.DEFAULT and self.key.tenant is None else self.tenant

    @property
    def letters_of(self) -> str | None:
        """Whose dead letters the viewer sees: the tenant's, or every one fleet-wide."""
        return None if self.acting_for is None else self.tenant

    @property
    def by(self) -> str:
        """How the console names the viewer in control messages and its record of actions."""
        return f"console:{self.key.name}"


def viewer(request: Request, keys: ApiKeys) -> Viewer | None:
    presented = request.headers.get("x-api-key") or request.cookies.get(KEY_COOKIE)
    key = keys.find(presented) if presented else None
    if key is None:
        return None
    tenant = key.tenant or tenancy.DEFAULT
    if key.admin:
        wanted = request.query_params.get("tenant") or request.cookies.get(TENANT_COOKIE)
        if wanted and tenancy.valid(wanted):
            tenant = wanted
    return Viewer(key, tenant)
