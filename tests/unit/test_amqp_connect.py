"""The broker addresses a process is given, how they are logged, and what connecting says when
none answers (closed local ports: no broker needed)."""

from __future__ import annotations

import socket

import pytest
from prometheus_client import CollectorRegistry

from contracts.client import LoopwireClient
from contracts.runtime.amqp import (
    AmqpMetrics,
    AmqpUnreachableError,
    address,
    connect,
    login,
    resolve_urls,
)
from tool_services.settings import Settings as ServiceSettings
from worker.settings import Settings as WorkerSettings


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_list_wins_over_the_single_url_and_is_comma_separated() -> None:
    assert resolve_urls("amqp://a/") == ("amqp://a/",)
    assert resolve_urls("amqp://a/", "") == ("amqp://a/",)
    assert resolve_urls("amqp://a/", " amqp://b/ ,amqp://c/,") == ("amqp://b/", "amqp://c/")
    assert resolve_urls("amqp://a/", ["amqp://b/"]) == ("amqp://b/",)


def test_settings_read_the_list_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOPWIRE_AMQP_URLS", "amqp://u:p@n1:5672/,amqp://u:p@n2:5672/")
    for settings in (WorkerSettings(), ServiceSettings()):
        assert resolve_urls(settings.amqp_url, settings.amqp_urls) == (
            "amqp://u:p@n1:5672/",
            "amqp://u:p@n2:5672/",
        )


def test_an_address_never_shows_the_user_or_password() -> None:
    assert address("amqp://user:s3cret@rabbit-1:5673/prod") == "rabbit-1:5673/prod"
    assert address("amqp://user:s3cret@rabbit-1/") == "rabbit-1:5672/"
    assert address("amqps://user:s3cret@rabbit-1") == "rabbit-1:5671/"


def test_the_client_takes_a_list_or_a_comma_separated_string() -> None:
    assert LoopwireClient(["amqp://a/", "amqp://b/"]).amqp_urls == ("amqp://a/", "amqp://b/")
    assert LoopwireClient("amqp://a/,amqp://b/").amqp_urls == ("amqp://a/", "amqp://b/")
    with pytest.raises(ValueError, match="no AMQP address"):
        LoopwireClient([])


async def test_no_address_answering_names_each_without_its_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG")
    ports = [closed_port(), closed_port()]
    urls = [f"amqp://user:s3cret-pw@127.0.0.1:{p}/vh" for p in ports]
    registry = CollectorRegistry()
    with pytest.raises(AmqpUnreachableError) as caught:
        await connect(urls, name="unit", metrics=AmqpMetrics(registry), timeout_s=2)
    message = str(caught.value)
    assert message.startswith(f"cannot reach RabbitMQ at 127.0.0.1:{ports[0]}/vh (")
    assert f"127.0.0.1:{ports[1]}/vh (" in message
    assert "s3cret-pw" not in message and "user" not in message
    assert "s3cret-pw" not in caplog.text
    for port in ports:
        connected = registry.get_sample_value(
            "loopwire_amqp_connected", {"address": f"127.0.0.1:{port}/vh"}
        )
        assert connected == 0
    assert registry.get_sample_value("loopwire_amqp_reconnects_total") == 0


@pytest.mark.parametrize(
    ("url", "user"),
    [
        ("amqp://loopwire-worker:pw@rabbit:5672/", "loopwire-worker"),
        ("amqp://rabbit:5672/", "guest"),
        ("amqps://rabbit:5671/?auth=external&cafile=/ca.pem", None),
    ],
)
def test_the_login_of_an_address_is_its_user_unless_a_certificate_names_it(
    url: str, user: str | None
) -> None:
    assert login(url) == user
