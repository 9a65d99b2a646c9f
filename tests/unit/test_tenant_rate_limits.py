"""A tenant's own model rate limits: which limiters a model call asks, with tenancy off and
on, in which order, and what a refusal charges (docs/tenants.md, "Fair")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from redis.asyncio import Redis

from contracts import keys, tenancy
from contracts.messages import ChatMessage
from contracts.state import ModelResponse
from contracts.turns import InputMessage, TurnRequest
from worker.loop.ports import LoopObserver
from worker.model.ratelimit import TenantRateLimits
from worker.runtime.tenancy import Tenancy
from worker.sequencing.actions import Delay, Reply, Step
from worker.settings import Settings, TenancySettings, TenantLimits
from worker.testing.broker import ScriptedAnswers
from worker.testing.memory import FunctionTools, ListSink, MemoryStore
from worker.testing.sequencing import sequencer_over


class Limiter:
    """Answers ``wait_s`` to every ask and records what it was asked."""

    def __init__(self, name: str, asked: list[str], wait_s: float = 0.0) -> None:
        self.name = name
        self.asked = asked
        self.wait_s = wait_s

    async def admit(self, messages: Sequence[ChatMessage], max_tokens: int | None) -> float:
        self.asked.append(f"{self.name} admit")
        return self.wait_s

    async def refund(self, messages: Sequence[ChatMessage], max_tokens: int | None) -> None:
        self.asked.append(f"{self.name} refund")


class Throttles(LoopObserver):
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def throttled(self, agent: str, reason: str) -> None:
        self.reasons.append(reason)


class Rig:
    def __init__(self, *, endpoint_wait: float | None = 0.0, tenants: dict[str, float]) -> None:
        self.asked: list[str] = []
        self.looked_up: list[str] = []
        self.observer = Throttles()
        self.model = ScriptedAnswers()
        endpoint = None if endpoint_wait is None else Limiter("endpoint", self.asked, endpoint_wait)
        own = {name: Limiter(name, self.asked, wait) for name, wait in tenants.items()}

        def tenant_limiter(tenant: str) -> Limiter | None:
            self.looked_up.append(tenant)
            return own.get(tenant)

        self.sequencer = sequencer_over(
            MemoryStore(),
            model=self.model,
            tools=FunctionTools({}),
            definitions=[],
            events=ListSink(),
            observer=self.observer,
            limiter=endpoint,
            tenant_limiter=tenant_limiter,
        )

    async def first_step(self, turn_id: str = "t1") -> list[Any]:
        self.model.answers.append(
            ModelResponse(message=ChatMessage(role="assistant", content="done"))
        )
        request = TurnRequest(
            turn_id=turn_id,
            session_id=f"s-{turn_id}",
            agent="support",
            input=(InputMessage(content="hi"),),
            reply_to="replies",
        )
        [step] = [a for a in await self.sequencer.on_request(request) if isinstance(a, Step)]
        return await self.sequencer.on_step(step.work)


def answered(actions: list[Any]) -> bool:
    return any(isinstance(a, Reply) for a in actions)


def parked(actions: list[Any]) -> bool:
    return any(isinstance(a, Delay) and a.work.wait_until is not None for a in actions)


async def test_tenancy_off_asks_the_endpoint_only() -> None:
    rig = Rig(tenants={"acme": 30.0})
    assert answered(await rig.first_step())
    assert rig.asked == ["endpoint admit"] and rig.looked_up == []


async def test_a_tenant_over_its_limit_is_throttled_and_nothing_else_is_asked() -> None:
    rig = Rig(tenants={"acme": 30.0})
    with tenancy.acting_for("acme"):
        assert parked(await rig.first_step())
    assert rig.asked == ["acme admit"], "refused by the tenant: the endpoint is not charged"
    assert rig.observer.reasons == ["tenant_rate_limit"]
    assert rig.model.requests == []


async def test_another_tenant_without_a_limit_asks_the_endpoint_only() -> None:
    rig = Rig(tenants={"acme": 30.0})
    with tenancy.acting_for("globex"):
        assert answered(await rig.first_step())
    assert rig.asked == ["endpoint admit"] and rig.looked_up == ["globex"]
    assert rig.observer.reasons == []


async def test_a_tenant_under_its_limit_asks_the_endpoint_after_it() -> None:
    rig = Rig(tenants={"acme": 0.0})
    with tenancy.acting_for("acme"):
        assert answered(await rig.first_step())
    assert rig.asked == ["acme admit", "endpoint admit"]


async def test_the_endpoint_refusing_gives_the_tenants_charge_back() -> None:
    rig = Rig(endpoint_wait=5.0, tenants={"acme": 0.0})
    with tenancy.acting_for("acme"):
        assert parked(await rig.first_step())
    assert rig.asked == ["acme admit", "endpoint admit", "acme refund"]
    assert rig.observer.reasons == ["rate_limit"]


async def test_a_tenant_limit_without_an_endpoint_limit() -> None:
    rig = Rig(endpoint_wait=None, tenants={"acme": 0.0})
    with tenancy.acting_for("acme"):
        assert answered(await rig.first_step())
    assert rig.asked == ["acme admit"]


def test_each_tenants_limits_are_its_own_over_the_defaults() -> None:
    rates = TenantRateLimits(
        Redis(),  # never connects: building a limiter asks Redis nothing
        requests_per_minute=10,
        tokens_per_minute=0,
        limits={"big": (100, None), "free": (0, 0), "tokens": (None, 5000), "plain": (None, None)},
    )
    assert rates.any
    big, tokens, other = rates.of("big"), rates.of("tokens"), rates.of("someone")
    assert big is not None and (big.rpm, big.tpm) == (100, 0)
    assert tokens is not None and (tokens.rpm, tokens.tpm) == (10, 5000)
    assert other is not None and (other.rpm, other.tpm) == (10, 0)
    assert rates.of("free") is None, "0 of its own: not limited"
    assert rates.of("big") is big, "built once"
    assert big.keys == [
        keys.tenant_rate_limit("big", "requests"),
        keys.tenant_rate_limit("big", "tokens"),
    ]
    assert big.keys[0] == "lw:rate:{tenant:big}:requests"


def test_no_limit_anywhere_is_none() -> None:
    rates = TenantRateLimits(
        Redis(), requests_per_minute=0, tokens_per_minute=0, limits={"shop": (None, None)}
    )
    assert not rates.any and rates.of("shop") is None
    assert TenantRateLimits(
        Redis(), requests_per_minute=0, tokens_per_minute=0, limits={"shop": (None, 60)}
    ).any


@pytest.mark.parametrize(
    ("tenants", "limited"),
    [
        (TenancySettings(enabled=False, requests_per_minute=10), False),
        (TenancySettings(enabled=True), False),
        (TenancySettings(enabled=True, limits={"shop": TenantLimits(max_running=2)}), False),
        (TenancySettings(enabled=True, tokens_per_minute=1000), True),
        (
            TenancySettings(enabled=True, limits={"shop": TenantLimits(requests_per_minute=5)}),
            True,
        ),
    ],
)
def test_the_worker_builds_tenant_limits_only_with_tenancy_on_and_a_limit(
    tenants: TenancySettings, limited: bool
) -> None:
    built = Tenancy.of(Settings(tenants=tenants), Redis(), set())
    assert (built.rates is not None) == limited
