"""TLS to RabbitMQ and Redis: the certificate files a process is given, and the one place each
client library's TLS options are built from them.

Settings. ``TlsFiles`` is three paths: the CA that signed the server's certificate
(``ca_file``; without it, the system's CAs), and a client certificate with its key
(``cert_file``, ``key_file``) for a server that asks for one. Every process reads them as
``LOOPWIRE_AMQP_TLS__CA_FILE``, ``LOOPWIRE_AMQP_TLS__CERT_FILE``,
``LOOPWIRE_AMQP_TLS__KEY_FILE`` and ``LOOPWIRE_REDIS_TLS__...`` (the worker's and the tool
services' settings, ``TlsSettings`` for the CLI and the memory service's events); the client
SDK takes a ``TlsFiles`` argument. They apply to every address of the list (every RabbitMQ
node, every Redis Cluster node).

What is verified. Always the server's certificate chain (against ``ca_file``) and that the
certificate names the host of the URL (``DNS:`` or ``IP:`` subject alternative name): there is
no setting that turns either off. A certificate that does not verify fails the connection;
the process says so and names the address (``host:port``), never a password.

Mistakes refused at start rather than guessed at: TLS files given for a URL that does not
speak TLS (``amqp://``, ``redis://``: the files would be silently unused), a key without its
certificate, (AMQP) files given both as settings and in a URL's query string, and a URL query
that would turn verification off (the factories check their library's options).
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Self, TypedDict

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from contracts.runtime.secrets import LoopwireSettings


class TlsConfigError(ValueError):
    """TLS settings that cannot be used (a file unreadable, files for a plain URL)."""


class TlsFiles(BaseModel):
    """A CA file and, optionally, a client certificate and its key (PEM files)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ca_file: Path | None = Field(
        default=None,
        description="CA certificate(s) the server's certificate must chain to (PEM); none: "
        "the system's CAs.",
    )
    cert_file: Path | None = Field(
        default=None, description="Client certificate (PEM), for a server that asks for one."
    )
    key_file: Path | None = Field(
        default=None, description="The client certificate's private key (PEM, not encrypted)."
    )

    @model_validator(mode="after")
    def _key_with_certificate(self) -> Self:
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("key_file is given without cert_file")
        return self

    @property
    def given(self) -> bool:
        """Whether any file is set."""
        return any(f is not None for f in (self.ca_file, self.cert_file, self.key_file))


class TlsSettings(LoopwireSettings):
    """``LOOPWIRE_AMQP_TLS__*`` and ``LOOPWIRE_REDIS_TLS__*`` alone, for a process without a
    settings class that holds them (the CLI, the memory service's event connection)."""

    model_config = SettingsConfigDict(frozen=True)

    amqp_tls: TlsFiles = TlsFiles()
    redis_tls: TlsFiles = TlsFiles()


def amqp_ssl_context(files: TlsFiles) -> ssl.SSLContext:
    """The ``ssl.SSLContext`` of an AMQP connection (aiormq takes a context): the server's
    certificate and host name verified against ``ca_file`` (or the system's CAs), the client
    certificate loaded when given."""
    try:
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=_path(files.ca_file, "ca_file")
        )
        if files.cert_file is not None:
            context.load_cert_chain(
                _path(files.cert_file, "cert_file") or "", _path(files.key_file, "key_file")
            )
    except (OSError, ValueError) as exc:
        raise TlsConfigError(f"cannot load the AMQP TLS files: {exc}") from None
    # the defaults of create_default_context, stated: they are what this module promises
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    return context


class RedisTlsOptions(TypedDict, total=False):
    """The keyword arguments of redis-py's TLS connections that loopwire sets."""

    ssl_cert_reqs: str
    ssl_check_hostname: bool
    ssl_ca_certs: str
    ssl_certfile: str
    ssl_keyfile: str


def redis_tls_options(files: TlsFiles) -> RedisTlsOptions:
    """redis-py's TLS options (it builds a context per connection from them): the server's
    certificate and host name verified, against ``ca_file`` when given."""
    options = RedisTlsOptions(ssl_cert_reqs="required", ssl_check_hostname=True)
    if files.ca_file is not None:
        options["ssl_ca_certs"] = _path(files.ca_file, "ca_file") or ""
    if files.cert_file is not None:
        options["ssl_certfile"] = _path(files.cert_file, "cert_file") or ""
    if files.key_file is not None:
        options["ssl_keyfile"] = _path(files.key_file, "key_file") or ""
    return options


def _path(path: Path | None, name: str) -> str | None:
    """``path`` as a string, once it is known to be readable (a clear error otherwise)."""
    if path is None:
        return None
    if not os.access(path, os.R_OK):
        raise TlsConfigError(f"TLS {name} {path} cannot be read")
    return str(path)
