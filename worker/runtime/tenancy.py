"""What the worker's tenancy settings make (docs/tenants.md), built once at start-up
(``worker.app``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import Redis

from contracts.turns import Budget
from worker.model.ratelimit import TenantRateLimits
from worker.session.tenant_slots import TenantSlots
from worker.settings import Settings
from worker.transport.intake import Intake
from worker.transport.tenants import Tenants


@dataclass(frozen=True, slots=True)
class Tenancy:
    """What the worker's tenancy settings make (docs/tenants.md): whose each message is, the
    tenants' caps on running turns (none: no cap), their daily budgets (none: tenancy off) and
    their own model rate limits (none: no tenant has any), and the tenants' own intake queues
    (worker/transport/intake.py)."""

    tenants: Tenants
    slots: TenantSlots | None
    budget: Callable[[str], Budget] | None
    rates: TenantRateLimits | None
    intake: Intake

    @staticmethod
    def of(s: Settings, redis: Redis, workers: set[str]) -> Tenancy:
        t = s.tenants
        tenants = Tenants(enabled=t.enabled, users=t.users, trusted={*t.trusted, *workers})
        if not t.enabled:
            return Tenancy(tenants, None, None, None, Intake(()))
        caps = {name: own.max_running for name, own in t.limits.items()}
        slots = None
        if t.max_running or any(caps.values()):
            own_caps = {name: cap for name, cap in caps.items() if cap is not None}
            slots = TenantSlots(
                redis, default_cap=t.max_running, limits=own_caps, lapse_s=s.state_ttl_s
            )

        def budget(tenant: str) -> Budget:
            own = t.limits.get(tenant)
            return own.daily_budget if own and own.daily_budget is not None else t.daily_budget

        rates = TenantRateLimits(
            redis,
            requests_per_minute=t.requests_per_minute,
            tokens_per_minute=t.tokens_per_minute,
            limits={
                name: (own.requests_per_minute, own.tokens_per_minute)
                for name, own in t.limits.items()
            },
        )
        intake = Intake(t.intake if t.intake is not None else sorted(set(t.users.values())))
        return Tenancy(tenants, slots, budget, rates if rates.any else None, intake)
