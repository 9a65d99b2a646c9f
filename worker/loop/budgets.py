"""Budgets: what a turn, a session and an agent in a day may spend, checked before every model
call.

Four scopes, three of them a ``Budget`` of the agent (``budget``, ``session_budget``,
``daily_budget``; a turn request may lower the per-turn one, never raise it): total tokens,
cost (from the workers' price table), tool calls and wall time. The session's spend is kept in
its state (``AgentState.spent``, its finished turns) and the agent's day in the store's
ledger (its finished turns that day, UTC); both are counted with the turn's own spend so far.
Other turns still running elsewhere are counted once they end. A turn's spend includes its child
turns' (its per-turn and session budgets count them); the agent's day counts only what the
turn spent itself, since each child adds its own to its agent's day: a model call counts once
in a day, for the agent that made it, however the turns nest. The fourth, while tenancy is
on, is the tenant's day (``LOOPWIRE_TENANTS__DAILY_BUDGET`` or its own in
``LOOPWIRE_TENANTS__LIMITS``), kept in the same ledger under ``tenant:<name>`` (an agent's
name has no ``:``) and counted as the agent's day is.

When one is spent the turn makes one last model call without tools, with the agent's
``budget_note``, and ends with ``finish_reason: budget`` and ``stopped_by`` naming the budget
(``turn.max_tool_calls`` …): a graceful answer, never an exception. A budget that cannot even
afford that call — wall time that is up, or a session or day spent before the turn called the
model at all — ends the turn at once with the last content.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts.state import AgentState, ExecutionState, Spend
from contracts.turns import Budget
from worker.loop.spec import AgentSpec

LIMITS = {
    "max_total_tokens": "total_tokens",
    "max_cost_usd": "cost_usd",
    "max_tool_calls": "tool_calls",
    "max_wall_s": "wall_s",
}
"""Each limit of a ``Budget`` and the ``Spend`` it bounds."""


@dataclass(frozen=True, slots=True)
class Spent:
    """A budget found spent: ``<scope>.<limit>``, its limit and what was used."""

    name: str
    limit: float
    used: float
    final_call: bool
    """Whether one last model call (without tools) is made before the turn ends."""


def turn_spend(ex: ExecutionState, now: float) -> Spend:
    return Spend(
        total_tokens=ex.usage.total_tokens,
        cost_usd=ex.cost_usd,
        tool_calls=ex.tool_calls,
        wall_s=max(0.0, now - ex.started_at),
    )


def own_spend(ex: ExecutionState, now: float) -> Spend:
    """What the turn spent itself, without its child turns' usage and cost: what its agent's
    day counts (each child's own day counts the child's, so each model call counts once)."""
    spend = turn_spend(ex, now)
    return spend.model_copy(
        update={
            "total_tokens": max(0, spend.total_tokens - ex.children_tokens),
            "cost_usd": max(0.0, spend.cost_usd - ex.children_cost_usd),
        }
    )


def configured(agent: AgentSpec, ex: ExecutionState) -> bool:
    """Whether any budget applies to the turn (if none, nothing is computed)."""
    return not (
        agent.budget.empty
        and ex.request.budget.empty
        and agent.session_budget.empty
        and agent.daily_budget.empty
    )


def tenant_ledger_name(tenant: str) -> str:
    """The tenant's day in the spend ledger, beside the agents'."""
    return f"tenant:{tenant}"


def first_spent(
    state: AgentState,
    agent: AgentSpec,
    now: float,
    today: Spend | None,
    tenant_today: tuple[Budget, Spend] | None = None,
) -> Spent | None:
    """The first budget that is spent, by scope (turn, session, agent's day, tenant's day)
    and limit; ``tenant_today``: the tenant's daily budget and its spend today."""
    ex = state.execution
    assert ex is not None
    mine = turn_spend(ex, now)
    scopes: list[tuple[str, Budget, Spend]] = [
        ("turn", agent.budget.lowered(ex.request.budget), mine),
        ("session", agent.session_budget, state.spent + mine),
    ]
    if today is not None:
        scopes.append(("agent_day", agent.daily_budget, today + own_spend(ex, now)))
    if tenant_today is not None:
        budget, spent = tenant_today
        scopes.append(("tenant_day", budget, spent + own_spend(ex, now)))
    called = ex.step_count > 0 or ex.usage.total_tokens > 0
    for scope, budget, spend in scopes:
        for limit_name, spend_name in LIMITS.items():
            limit = getattr(budget, limit_name)
            used = getattr(spend, spend_name)
            if limit is not None and used >= limit:
                spent_before = scope != "turn" and not called
                final = limit_name != "max_wall_s" and not spent_before
                return Spent(f"{scope}.{limit_name}", float(limit), float(used), final)
    return None
