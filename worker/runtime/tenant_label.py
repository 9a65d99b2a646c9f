"""The ``tenant`` label of the worker's metrics (``worker.runtime.metrics``): the current tenant for
the first few tenants a process counts, ``other`` for the rest, so that Prometheus's series
stay bounded however many tenants there are."""

from __future__ import annotations

from typing import Final

from contracts import tenancy
from worker.settings import TenancySettings

OTHER_TENANTS: Final = "other"
"""The ``tenant`` label of every tenant past the cap."""
UNKNOWN_TENANT: Final = "_unknown"
"""The ``tenant`` label of work whose tenant is not known (refused: ``tenant_mismatch``); no
tenant name starts with ``_``."""


class TenantLabel:
    """The value of the ``tenant`` label: the current tenant (``contracts.tenancy``) for the
    first ``cap`` distinct tenants this process labels, ``other`` for every later one (which
    stays ``other``: a series, once begun, keeps its tenant)."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"a cap of {cap} tenants: at least 1")
        self.cap = cap
        self.labelled: set[str] = set()

    def __call__(self) -> str:
        return self.of(tenancy.current())

    def of(self, tenant: str | None) -> str:
        if tenant is None:
            return UNKNOWN_TENANT
        if tenant in self.labelled:
            return tenant
        if len(self.labelled) < self.cap:
            self.labelled.add(tenant)
            return tenant
        return OTHER_TENANTS


def tenant_label(tenants: TenancySettings) -> TenantLabel | None:
    """The ``tenant`` label of the metrics: only with tenancy on and the label asked for."""
    if tenants.enabled and tenants.metrics_label:
        return TenantLabel(tenants.metrics_max_tenants)
    return None
