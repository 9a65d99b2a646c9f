"""RabbitMQ nodes of a test's own, started from the machine's ``rabbitmq-server`` on local
ports, so a test can stop the broker without touching the shared one.

Two local facts: the machine's configuration file pins the listener to 5672, so a node gets
its own ``RABBITMQ_CONFIG_FILE`` and an empty ``RABBITMQ_ENABLED_PLUGINS_FILE`` (the shared
plugins would fight over ports); and ``rabbitmq-server`` drops to the ``rabbitmq`` user, so
the node's directories belong to it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class RabbitNode:
    """One RabbitMQ node: ``start()``, ``stop_app()`` / ``start_app()`` (the broker goes away
    and comes back, as in a restart), ``close()`` (halts it and removes its files).

    ``config``: more lines of its ``rabbitmq.conf`` (a TLS listener, ``ssl_options.*``), and
    ``ports``: the further ports it must open before it counts as started. Files it must read
    (certificates, keys) go in ``dir`` before ``start()``, which gives them to the ``rabbitmq``
    user."""

    def __init__(
        self, name: str | None = None, *, config: Sequence[str] = (), ports: Sequence[int] = ()
    ) -> None:
        if shutil.which("rabbitmq-server") is None:
            raise RuntimeError("rabbitmq-server is not installed: a private node cannot start")
        self.port = _free_port()
        self.dist_port = _free_port()
        self.config = tuple(config)
        self.ports = tuple(ports)
        self.name = name or f"lwtest{self.port}@localhost"
        self.dir = Path(tempfile.mkdtemp(prefix="loopwire-rabbit-"))
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_PID_FILE": str(self.dir / "mnesia" / "node.pid"),
        }

    def ctl(self, *args: str, timeout: float = 60) -> str:
        """``rabbitmqctl -n <this node> ...``; its output. A failure names the command."""
        done = subprocess.run(
            ["rabbitmqctl", "-q", "-n", self.name, *args],
            env=self._env(),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"rabbitmqctl -n {self.name} {' '.join(args)}: "
                f"{(done.stderr or done.stdout).decode(errors='replace').strip()}"
            )
        return done.stdout.decode(errors="replace")

    def start(self, timeout: float = 60) -> None:
        (self.dir / "mnesia").mkdir()
        (self.dir / "log").mkdir()
        (self.dir / "rabbitmq.conf").write_text(
            "\n".join(
                [
                    f"listeners.tcp.local = 127.0.0.1:{self.port}",
                    "loopback_users = none",
                    *self.config,
                ]
            )
            + "\n"
        )
        (self.dir / "enabled_plugins").write_text("[].\n")
        self.dir.chmod(0o755)
        if os.geteuid() == 0:
            shutil.chown(self.dir, "rabbitmq", "rabbitmq")
            for path in self.dir.rglob("*"):
                shutil.chown(path, "rabbitmq", "rabbitmq")
        subprocess.run(
            ["rabbitmq-server", "-detached"], env=self._env(), check=True, capture_output=True
        )
        self._wait_open(timeout)

    def _wait_open(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for port in (self.port, *self.ports):
            while not _port_open(port):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"RabbitMQ node {self.name} did not open port {port}")
                time.sleep(0.2)

    def stop_app(self) -> None:
        self.ctl("stop_app")

    def start_app(self) -> None:
        self.ctl("start_app")
        self._wait_open(60)

    def close(self) -> None:
        """Halt the node (``rabbitmqctl stop``; when that fails, its own OS process is killed)
        and remove its files."""
        try:
            self.ctl("stop", timeout=60)
        except (subprocess.SubprocessError, OSError, RuntimeError):
            self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            pid = int((self.dir / "mnesia" / "node.pid").read_text().strip())
            # the pid is this node's only while its environment names the node's directory
            if str(self.dir).encode() in Path(f"/proc/{pid}/environ").read_bytes():
                os.kill(pid, signal.SIGKILL)
