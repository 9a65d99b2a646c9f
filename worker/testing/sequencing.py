"""A ``SessionSequencer`` over given parts, wired as ``worker.app`` wires the real ones (one loop
per step, over that step's session), for tests and for running turns in one process."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from contracts.events import DEFAULT_EVENTS
from contracts.tools import ToolDefinition
from worker.agents import AgentProfile, AgentProfiles
from worker.loop import EventSink, Hook, Loop, Model, ToolCaller
from worker.loop.ports import LoopObserver, Price, SpendLedger, free
from worker.sequencer import SessionSequencer
from worker.session.leases import LeaseKeeper
from worker.session.port import SessionStore, StepSession
from worker.settings import ModelSettings
from worker.testing.memory import StaticCatalog
from worker.tracing import Tracing


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
) -> SessionSequencer:
    """Every agent in ``agents`` (a name: a profile with defaults) may use every tool of
    ``definitions``; ``clock``: the time of the loops and the sequencer."""

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
    )
