"""Whose message it is (``worker.transport.tenants``) and what follows from the tenant a task
acts for (``contracts.tenancy``): keys, idempotency keys, routing keys, headers."""

from __future__ import annotations

import time

import pytest

from contracts import keys, tenancy
from contracts import topology as t
from contracts.tools import idempotency_key
from contracts.work import StepWork
from worker.errors import PermanentError
from worker.testing.broker import MemoryPublisher
from worker.transport.outbox import Outbox
from worker.transport.tenants import Tenants

ON = Tenants(enabled=True, users={"shop-app": "shop"}, trusted={"gateway", "worker"})


def refused(sender: str | None, headers: dict[str, object] | None = None) -> str:
    with pytest.raises(PermanentError) as caught:
        ON.of(sender, headers or {})
    assert caught.value.code == "tenant_mismatch"
    return str(caught.value)


def test_off_every_message_is_no_ones_whatever_it_says() -> None:
    off = Tenants()
    assert off.of(None, {}) is None
    assert off.of("anyone", {tenancy.H_TENANT: "acme"}) is None


def test_a_users_tenant_is_its_mapping_or_its_own_name() -> None:
    assert ON.of("shop-app", {}) == "shop"
    assert ON.of("acme", {}) == "acme"
    assert ON.of("shop-app", {tenancy.H_TENANT: "shop"}) == "shop"  # its own: fine
    assert ON.of("shop-app", {tenancy.H_TENANT: b"shop"}) == "shop"


def test_what_nothing_vouches_for_is_refused_with_the_reason() -> None:
    assert "no user_id" in refused(None)
    assert "acts for tenant 'shop' only, not 'acme'" in refused(
        "shop-app", {"x-loopwire-tenant": "acme"}
    )
    assert "map it to one in LOOPWIRE_TENANTS__USERS" in refused("ops@example.com")


def test_a_trusted_user_acts_for_the_tenant_it_names() -> None:
    assert ON.of("gateway", {tenancy.H_TENANT: "acme"}) == "acme"
    assert ON.of("worker", {tenancy.H_TENANT: "shop"}) == "shop"
    assert ON.of("gateway", {}) == "gateway"  # naming none: its own
    assert "is no tenant" in refused("gateway", {tenancy.H_TENANT: "a.b"})


def test_a_mapping_to_no_tenant_name_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="not a tenant name"):
        Tenants(enabled=True, users={"app": "a/b"})


def test_keys_routing_keys_and_headers_follow_the_tenant_acted_for() -> None:
    assert tenancy.current() is None
    assert keys.session_state("s1") == "lw:{s1}:state"
    assert keys.turn_session("t1") == "lw:turn:t1:session"
    assert keys.approvals_waiting() == "lw:approvals:waiting"
    assert idempotency_key("t1", "c1") == "t1:c1"
    assert tenancy.routed("turn.finished.a.t1") == "turn.finished.a.t1"
    assert tenancy.headers() == {}
    with tenancy.acting_for("default"):  # tenancy on, the default tenant: the same keys
        assert keys.session_state("s1") == "lw:{s1}:state"
        assert idempotency_key("t1", "c1") == "t1:c1"
        assert tenancy.routed("turn.finished.a.t1") == "default.turn.finished.a.t1"
    with tenancy.acting_for("acme"):
        assert keys.session_state("s1") == "lw:{acme/s1}:state"
        assert keys.turn_steps("s1", "t1") == "lw:{acme/s1}:turn:t1:steps"
        assert keys.turn_session("t1") == "lw:turn:acme/t1:session"
        assert keys.approvals_waiting() == "lw:approvals:acme:waiting"
        assert idempotency_key("t1", "c1") == "acme/t1:c1"
        assert tenancy.routed("turn.finished.a.t1") == "acme.turn.finished.a.t1"
        assert tenancy.headers() == {"x-loopwire-tenant": "acme"}
    assert tenancy.current() is None
    with pytest.raises(ValueError, match="not a tenant name"), tenancy.acting_for("a.b"):
        pass


def test_a_message_in_a_tenants_intake_is_that_tenants_own() -> None:
    lane = t.intake_tenant(t.INTAKE_EXCHANGE, t.intake_key("shop"))
    assert lane == "shop"
    assert ON.of("shop-app", {}, lane) == "shop"
    assert ON.of("gateway", {tenancy.H_TENANT: "shop"}, lane) == "shop"
    with pytest.raises(PermanentError) as caught:
        ON.of("acme", {}, lane)
    assert "a message of tenant 'acme' in the intake of tenant 'shop'" in str(caught.value)
    assert caught.value.code == "tenant_mismatch"
    # the same key on another exchange, or another key on the intake: no lane
    assert t.intake_tenant(t.REQUESTS_EXCHANGE, t.intake_key("shop")) is None
    assert t.intake_tenant(t.INTAKE_EXCHANGE, "shop.sessions") is None
    assert t.intake_tenant(t.INTAKE_EXCHANGE, "a.b.turns") is None  # no tenant has a dot
    assert t.intake_tenant("", t.TURNS_QUEUE) is None
    assert Tenants().of("acme", {}, lane) is None  # tenancy off: nobody's, wherever it came


async def test_work_of_a_tenant_with_an_intake_queue_goes_to_it_and_the_rest_as_before() -> None:
    shared, intake = MemoryPublisher(), MemoryPublisher()
    outbox = Outbox(shared, "worker", intake, frozenset({"shop"}))
    work = StepWork(turn_id="t1", session_id="s1", step=2)
    with tenancy.acting_for("shop"):
        await outbox.publish_step(work)
        await outbox.publish_wait(work.model_copy(update={"wait_until": time.time() + 30}))
    with tenancy.acting_for("acme"):
        await outbox.publish_step(work)
    await outbox.publish_step(work)  # tenancy off
    assert [p.routing_key for p in intake.published] == ["shop.turns"]
    assert [p.routing_key for p in shared.published] == [
        t.wait_queue(16),
        t.TURNS_QUEUE,
        t.TURNS_QUEUE,
    ]
    assert intake.published[0].properties.headers[tenancy.H_TENANT] == "shop"
