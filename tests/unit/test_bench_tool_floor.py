"""The tool protocol floor answers what the SDK's calculator answers, in the reply contract."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from contracts.codec import decode
from contracts.tools import ToolCallReply
from tests.bench.tool_floor import calculate, call_keys
from tool_services.calculator import service


@pytest.mark.parametrize("expression", ["6*7", "2**100 / 3", "sqrt(9/4) + 0.1"])
def test_the_floor_runs_the_calculators_function(expression: str) -> None:
    reply = decode(msgpack.packb(calculate("call_1", {"expression": expression})), ToolCallReply)
    sdk = asyncio.run(service.calculate(service.CalculateArgs(expression=expression), None))  # type: ignore[arg-type]
    assert reply == ToolCallReply(call_id="call_1", status="ok", value=sdk)


def test_an_expression_the_calculator_refuses_is_an_error_reply() -> None:
    for arguments in ({"expression": "sqrt(2)"}, {"expression": 7}, {}):
        reply = decode(msgpack.packb(calculate("call_1", arguments)), ToolCallReply)
        assert reply.status == "error"
        assert reply.error


def test_the_claim_and_its_lease_share_a_hash_tag() -> None:
    claim, lease = call_keys("turn-1:call_1")
    assert claim.split("{")[1].split("}")[0] == lease.split("{")[1].split("}")[0] == "turn-1:call_1"
