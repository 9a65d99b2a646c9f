"""The TLS settings every process reads, and what the two client factories make of them (no
server needed: the end-to-end proof over real TLS listeners is tests/cluster/test_tls.py)."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from pydantic import ValidationError

from contracts.client import LoopwireClient
from contracts.runtime.amqp import tls_context
from contracts.runtime.redis_client import redis_client
from contracts.runtime.tls import (
    TlsConfigError,
    TlsFiles,
    TlsSettings,
    amqp_ssl_context,
    redis_tls_options,
)
from tool_services.memory.service import MemorySettings
from tool_services.settings import Settings as ServiceSettings
from worker.settings import Settings as WorkerSettings

SYSTEM_CA = Path(ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt")


def test_every_process_reads_the_same_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOPWIRE_AMQP_TLS__CA_FILE", "/certs/ca.pem")
    monkeypatch.setenv("LOOPWIRE_AMQP_TLS__CERT_FILE", "/certs/client.pem")
    monkeypatch.setenv("LOOPWIRE_AMQP_TLS__KEY_FILE", "/certs/client.key")
    monkeypatch.setenv("LOOPWIRE_REDIS_TLS__CA_FILE", "/certs/redis-ca.pem")
    amqp = TlsFiles(
        ca_file=Path("/certs/ca.pem"),
        cert_file=Path("/certs/client.pem"),
        key_file=Path("/certs/client.key"),
    )
    redis = TlsFiles(ca_file=Path("/certs/redis-ca.pem"))
    for settings in (WorkerSettings(), ServiceSettings(), TlsSettings()):
        assert settings.amqp_tls == amqp
        assert settings.redis_tls == redis
    assert MemorySettings().amqp_tls == amqp


def test_a_tls_variable_is_a_path_not_a_secret_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # LOOPWIRE_AMQP_TLS__CA_FILE ends in _FILE, as the secret-file form of a setting does:
    # it is the setting ca_file (a path), not the file holding a setting "ca"
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("LOOPWIRE_REDIS_TLS__CA_FILE", str(ca))
    assert WorkerSettings().redis_tls.ca_file == ca


def test_nothing_is_set_by_default() -> None:
    assert not WorkerSettings().amqp_tls.given
    assert not ServiceSettings().redis_tls.given


def test_a_key_without_its_certificate_is_refused() -> None:
    with pytest.raises(ValidationError, match="key_file is given without cert_file"):
        TlsFiles(key_file=Path("/certs/client.key"))


def test_the_amqp_context_verifies_the_server_and_its_name() -> None:
    context = amqp_ssl_context(TlsFiles(ca_file=SYSTEM_CA))
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname


def test_the_redis_options_verify_the_server_and_its_name() -> None:
    options = redis_tls_options(TlsFiles(ca_file=SYSTEM_CA))
    assert options == {
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": True,
        "ssl_ca_certs": str(SYSTEM_CA),
    }


def test_a_missing_file_is_named() -> None:
    with pytest.raises(TlsConfigError, match=r"/nowhere/ca\.pem cannot be read"):
        amqp_ssl_context(TlsFiles(ca_file=Path("/nowhere/ca.pem")))
    with pytest.raises(TlsConfigError, match=r"/nowhere/ca\.pem cannot be read"):
        redis_client("rediss://127.0.0.1:6380/0", tls=TlsFiles(ca_file=Path("/nowhere/ca.pem")))


def test_tls_files_for_a_plain_url_are_refused() -> None:
    files = TlsFiles(ca_file=SYSTEM_CA)
    with pytest.raises(TlsConfigError, match=r"127\.0\.0\.1:5672/ is not an amqps:// address"):
        tls_context(["amqp://u:secret@127.0.0.1:5672/"], files)
    with pytest.raises(TlsConfigError, match=r"127\.0\.0\.1:6379 is not a rediss:// address"):
        redis_client("redis://u:secret@127.0.0.1:6379/0", tls=files)


def test_files_in_both_the_settings_and_the_url_are_refused() -> None:
    with pytest.raises(TlsConfigError, match="not both"):
        tls_context(["amqps://u:p@rabbit:5671/?cafile=/certs/ca.pem"], TlsFiles(ca_file=SYSTEM_CA))


def test_one_context_serves_every_address() -> None:
    context = tls_context(
        ["amqps://u:p@rabbit-1:5671/", "amqps://u:p@rabbit-2:5671/"], TlsFiles(ca_file=SYSTEM_CA)
    )
    assert isinstance(context, ssl.SSLContext)
    assert tls_context(["amqps://u:p@rabbit-1:5671/"], TlsFiles()) is None


def test_the_redis_factory_gives_the_files_to_every_node() -> None:
    files = TlsFiles(ca_file=SYSTEM_CA)
    single = redis_client("rediss://127.0.0.1:6380/0", tls=files)
    kwargs = single.connection_pool.connection_kwargs
    assert kwargs["ssl_ca_certs"] == str(SYSTEM_CA)
    assert kwargs["ssl_check_hostname"] is True
    cluster = redis_client("rediss+cluster://127.0.0.1:7001,127.0.0.1:7002/", tls=files)
    node_kwargs = cluster.nodes_manager.connection_kwargs  # type: ignore[attr-defined]
    assert node_kwargs["ssl_ca_certs"] == str(SYSTEM_CA)


def test_the_client_takes_the_files() -> None:
    files = TlsFiles(ca_file=SYSTEM_CA)
    assert LoopwireClient("amqps://u:p@rabbit:5671/", tls=files).tls == files


@pytest.mark.parametrize(
    "url",
    [
        "rediss://127.0.0.1:6380/0?ssl_cert_reqs=none",
        "rediss://127.0.0.1:6380/0?ssl_check_hostname=false",
    ],
)
def test_turning_redis_verification_off_in_the_url_is_refused(url: str) -> None:
    with pytest.raises(TlsConfigError, match="verification off is refused"):
        redis_client(url)


def test_turning_amqp_verification_off_in_the_url_is_refused() -> None:
    with pytest.raises(TlsConfigError, match="no_verify_ssl is refused"):
        tls_context(["amqps://u:p@rabbit:5671/?no_verify_ssl=1"], None)
    assert tls_context(["amqps://u:p@rabbit:5671/?no_verify_ssl=0"], None) is None
