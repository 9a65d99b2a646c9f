"""A ``SessionSequencer`` over given parts, wired as ``worker.app`` wires the real ones (one loop
per step, over that step's session), for tests and for running turns in one process."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from contracts.events import DEFAULT_EVENTS
from contracts.tools import ToolDefinition
from contracts.turns import Budget
from worker.loop import EventSink, Hook, Loop, Model, ToolCaller
from worker.loop.ports import (
    LoopObserver,
    Price,
    RateLimiter,
    RefundableLimiter,
    SpendLedger,
    free,
)
from worker.profiles.agents import AgentProfile, AgentProfiles
from worker.runtime.tracing import Tracing
from worker.sequencing.sequencer import SessionSequencer
from worker.session.leases import LeaseKeeper
from worker.session.port import SessionStore, StepSession
from worker.session.tenant_slots import TenantSlots
from worker.settings import ModelSettings
from worker.testing.memory import StaticCatalog


def sequencer_over(
    store: SessionStore,
    *,
    model: Model,
    tools: ToolCaller,
    definitions: Sequence[ToolDefinition],
    events: EventSink,
    hooks: Hook | None = None,
    observer: LoopObserver | None = None,
    agents: Sequence[str | AgentProfile] = ("support",),
    price: Price = free,
    ledger: SpendLedger | None = None,
    announced: frozenset[str] | None = None,
    tracing: Tracing | None = None,
    clock: Callable[[], float] = time.time,
    tenant_budget: Callable[[str], Budget] | None = None,
    slots: TenantSlots | None = None,
    limiter: RateLimiter | None = None,
    tenant_limiter: Callable[[str], RefundableLimiter | None] | None = None,
) -> SessionSequencer:
    """Every agent in ``agents`` (a name: a profile with defaults) may use every tool of
    ``definitions``; ``clock``: the loops' and the sequencer's time; ``tenant_budget``: the
    tenants' daily budgets (``contracts.tenancy``); ``limiter``, ``tenant_limiter``: the
    endpoint's and the tenants' model rate limits."""

    def loop_factory(session: StepSession, _profile: AgentProfile, redone: bool) -> Loop:
        return Loop(
            model=model
            if tracing is None
            else tracing.model(model, "default", ModelSettings(model="scripted")),
            tools=tools if tracing is None else tracing.tools(tools),
            catalog=StaticCatalog(definitions),
            store=session,
            events=events,
            hooks=hooks,
            observer=observer,
            price=price,
            ledger=ledger,
            announced=frozenset(DEFAULT_EVENTS) if announced is None else announced,
            redone=redone,
            clock=clock,
            tenant_budget=tenant_budget,
            limiter=limiter,
            tenant_limiter=tenant_limiter,
        )

    return SessionSequencer(
        store=store,
        leases=LeaseKeeper(store),
        profiles=AgentProfiles(
            agents=tuple(a if isinstance(a, AgentProfile) else AgentProfile(name=a) for a in agents)
        ),
        loop_factory=loop_factory,
        events=events,
        tracing=tracing,
        clock=clock,
        slots=slots,
    )
