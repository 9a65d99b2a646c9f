"""The one connect function on the real broker: an address that does not answer is passed
over for the next one, and the process says where it is connected."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from contracts.runtime.amqp import AmqpMetrics, address, connect
from harness import AMQP_URL, free_port


async def test_an_address_that_does_not_answer_is_passed_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO")
    dead = f"amqp://guest:not-this-one@127.0.0.1:{free_port()}/"
    registry = CollectorRegistry()
    connection = await connect(
        [dead, AMQP_URL], name="failover-test", metrics=AmqpMetrics(registry)
    )
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True)
        assert queue.name
        assert (
            registry.get_sample_value("loopwire_amqp_connected", {"address": address(AMQP_URL)})
            == 1
        )
        assert registry.get_sample_value("loopwire_amqp_connected", {"address": address(dead)}) == 0
    finally:
        await connection.close()
    assert f"failover-test: could not connect to {address(dead)}" in caplog.text
    assert f"failover-test: connected to the broker at {address(AMQP_URL)}" in caplog.text
    assert "not-this-one" not in caplog.text
