"""TLS listeners of a test's own: a local CA made with ``openssl``, a RabbitMQ node
(``lwtls@localhost``, a ``RabbitNode`` of ``tests/integration/nodes.py``) with a TLS listener
that requires a client certificate, and a ``redis-server`` with only a TLS port that requires
one too. Each has a user with a random password, so a test can check that it never shows.

Certificates: a CA, a server certificate for ``DNS:localhost`` and ``IP:127.0.0.1``, a client
certificate, and a second CA that signed none of them (a process given it must refuse the
servers). EC P-256 keys, valid for a day. Everything started is stopped by the fixtures, also
after a failed start; a missing ``openssl``, ``rabbitmq-server`` or ``redis-server`` fails.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from contracts.runtime.tls import TlsFiles
from tests.integration.harness import free_port
from tests.integration.nodes import RabbitNode

NODE_NAME = "lwtls@localhost"
USER = "loopwire"
EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Pki:
    dir: Path

    def path(self, name: str) -> Path:
        return self.dir / name

    @property
    def client(self) -> TlsFiles:
        """The right CA and the client certificate."""
        return TlsFiles(
            ca_file=self.path("ca.pem"),
            cert_file=self.path("client.pem"),
            key_file=self.path("client.key"),
        )

    @property
    def wrong_ca(self) -> TlsFiles:
        """A CA that signed none of the servers' certificates (and the right client one)."""
        return self.client.model_copy(update={"ca_file": self.path("other-ca.pem")})


def _openssl(*args: str, cwd: Path) -> None:
    tool = shutil.which("openssl")
    assert tool, "openssl is not installed"
    done = subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"openssl {' '.join(args)}: {done.stderr}"


def make_pki(folder: Path) -> Pki:
    """``ca.pem``, ``server.pem``/``.key``, ``client.pem``/``.key`` and ``other-ca.pem``."""
    for ca in ("ca", "other-ca"):
        _openssl(
            "req", "-x509", *EC_KEY, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "1",
            "-subj", f"/CN=loopwire test {ca}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=folder,
        )  # fmt: skip
    for leaf, usage, names in (
        ("server", "serverAuth", "DNS:localhost,IP:127.0.0.1"),
        ("client", "clientAuth", "DNS:loopwire-client"),
    ):
        (folder / f"{leaf}.ext").write_text(
            f"subjectAltName={names}\nextendedKeyUsage={usage}\n"
            "keyUsage=critical,digitalSignature\nbasicConstraints=CA:FALSE\n"
        )
        _openssl(
            "req", *EC_KEY, "-keyout", f"{leaf}.key", "-out", f"{leaf}.csr",
            "-subj", f"/CN=loopwire test {leaf}", cwd=folder,
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{leaf}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-out", f"{leaf}.pem", "-extfile", f"{leaf}.ext",
            cwd=folder,
        )  # fmt: skip
    return Pki(folder)


class TlsRabbit:
    """A RabbitMQ node whose TLS listener verifies clients and requires their certificate."""

    def __init__(self, pki: Pki) -> None:
        self.tls_port = free_port()
        self.password = secrets.token_hex(12)
        # the node runs as the rabbitmq user: its certificate files are that user's
        self.certs = Path(tempfile.mkdtemp(prefix="loopwire-rabbit-tls-"))
        for name in ("ca.pem", "server.pem", "server.key"):
            shutil.copy(pki.path(name), self.certs / name)
        if os.geteuid() == 0:
            for path in (self.certs, *self.certs.iterdir()):
                shutil.chown(path, "rabbitmq", "rabbitmq")
        self.node = RabbitNode(
            NODE_NAME,
            config=[
                f"listeners.ssl.local = 127.0.0.1:{self.tls_port}",
                f"ssl_options.cacertfile = {self.certs / 'ca.pem'}",
                f"ssl_options.certfile = {self.certs / 'server.pem'}",
                f"ssl_options.keyfile = {self.certs / 'server.key'}",
                "ssl_options.verify = verify_peer",
                "ssl_options.fail_if_no_peer_cert = true",
            ],
            ports=[self.tls_port],
        )

    def url(self, host: str = "localhost") -> str:
        return f"amqps://{USER}:{self.password}@{host}:{self.tls_port}/"

    def start(self) -> None:
        subprocess.run(  # a node of this name left by a killed run
            ["rabbitmqctl", "-q", "-n", NODE_NAME, "stop"],
            capture_output=True,
            timeout=60,
            check=False,
        )
        self.node.start(timeout=120)
        self.node.ctl("add_user", USER, self.password)
        self.node.ctl("set_permissions", "-p", "/", USER, ".*", ".*", ".*")

    def stop(self) -> None:
        self.node.close()
        shutil.rmtree(self.certs, ignore_errors=True)


class TlsRedis:
    """A ``redis-server`` with only a TLS port, requiring a client certificate and a password."""

    def __init__(self, pki: Pki, folder: Path) -> None:
        self.pki = pki
        self.folder = folder
        self.port = free_port()
        self.password = secrets.token_hex(12)
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, host: str = "127.0.0.1") -> str:
        return f"rediss://:{self.password}@{host}:{self.port}/0"

    def start(self, timeout: float = 20) -> None:
        server = shutil.which("redis-server")
        assert server, "redis-server is not installed"
        p = self.pki.path
        self.process = subprocess.Popen(
            [server, "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
             "--tls-cert-file", str(p("server.pem")), "--tls-key-file", str(p("server.key")),
             "--tls-ca-cert-file", str(p("ca.pem")), "--tls-auth-clients", "yes",
             "--requirepass", self.password, "--save", "", "--appendonly", "no",
             "--dir", str(self.folder)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(
            host="127.0.0.1",
            port=self.port,
            password=self.password,
            ssl=True,
            ssl_ca_certs=str(p("ca.pem")),
            ssl_certfile=str(p("client.pem")),
            ssl_keyfile=str(p("client.key")),
            socket_timeout=2,
        )
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited ({self.process.returncode})")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.1)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_rabbit(pki: Pki) -> Iterator[TlsRabbit]:
    rabbit = TlsRabbit(pki)
    try:
        rabbit.start()
        yield rabbit
    finally:
        rabbit.stop()


@pytest.fixture(scope="module")
def tls_redis(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    server = TlsRedis(pki, tmp_path_factory.mktemp("redis-tls"))
    try:
        server.start()
        yield server
    finally:
        server.stop()
