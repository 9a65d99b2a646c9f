"""``loopwire --tenant NAME dlq``: the letters of that tenant only, as their
``x-loopwire-tenant`` header names it (contracts.dead_letters)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from contracts import tenancy
from contracts import topology as t
from contracts.dead_letters import _of, describe


def letter(**headers: Any) -> Any:
    return SimpleNamespace(
        headers={t.H_DEAD_ID: "d1", t.H_REASON_CODE: "unknown_agent", **headers},
        body=b"\x80",
        message_id=None,
    )


def test_a_letter_names_its_tenant_when_its_header_does() -> None:
    assert describe(letter(**{tenancy.H_TENANT: "acme"})).tenant == "acme"
    assert describe(letter(**{tenancy.H_TENANT: b"acme"})).tenant == "acme"
    assert describe(letter()).tenant is None


def test_a_tenant_sees_its_own_letters_and_no_one_elses() -> None:
    acme, globex, nobody = (
        letter(**{tenancy.H_TENANT: "acme"}),
        letter(**{tenancy.H_TENANT: "globex"}),
        letter(),
    )
    assert [_of(m, "acme") for m in (acme, globex, nobody)] == [True, False, False]
    assert [_of(m, None) for m in (acme, globex, nobody)] == [True, True, True]
