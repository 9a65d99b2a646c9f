"""The HTTP gateway as its users run it: ``loopwire gateway serve`` in a process of its own,
with a keys file of its own, in front of a worker (harness.WorkerProcess)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import aio_pika
import aiohttp
from support_rpc import AMQP_URL, REDIS_URL

from contracts import topology as t
from gateway.http.keys import new_key
from harness import ROOT, free_port


async def drop_console_queue() -> None:
    """The console's shared queue of events (gateway/console/feed.py) holds every event since
    the last gateway stopped (up to its bound): a gateway of a test starts without the other
    tests' backlog."""
    connection = await aio_pika.connect(AMQP_URL)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(t.GATEWAY_CONSOLE_QUEUE)


class GatewayProcess:
    """``async with GatewayProcess(agents_file, {"acme": "acme", "plain": None}) as g``:
    ``g.url``, and ``g.keys[name]`` the API key of each named key (acting for its tenant)."""

    def __init__(
        self,
        agents_file: Path,
        tenants: dict[str, str | None],
        *,
        replica_of: GatewayProcess | None = None,
        admins: tuple[str, ...] = (),
        **env: str,
    ) -> None:
        """``replica_of``: another replica, whose keys file this one serves too; ``admins``:
        the names of the keys that see every tenant in the console."""
        self.fresh_console = replica_of is None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        folder = Path(tempfile.mkdtemp(prefix="loopwire-gateway-"))
        self.keys: dict[str, str] = {}
        entries = []
        for name, tenant in tenants.items():
            key, entry = new_key(name, tenant)
            self.keys[name] = key
            if name in admins:
                entry.admin = True
            entries.append(entry.model_dump(exclude_none=True, exclude_defaults=True))
        keys_file = folder / "keys.json"
        keys_file.write_text(json.dumps({"keys": entries}))
        if replica_of is not None:
            keys_file, self.keys = replica_of.keys_file, replica_of.keys
        self.keys_file = keys_file
        self.log_path = folder / "gateway.log"
        self.env = {
            **os.environ,
            "LOOPWIRE_AMQP_URL": AMQP_URL,
            "LOOPWIRE_REDIS_URL": REDIS_URL,
            "LOOPWIRE_AGENTS_FILE": str(agents_file),
            "LOOPWIRE_GATEWAY__PORT": str(self.port),
            "LOOPWIRE_GATEWAY__KEYS_FILE": str(keys_file),
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None

    async def __aenter__(self) -> GatewayProcess:
        if self.fresh_console:
            await drop_console_queue()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "worker.cli", "gateway", "serve"],
                env=self.env,
                cwd=ROOT,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + 20
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the gateway exited: {self.log()}")
                try:
                    async with session.get(f"{self.url}/readyz") as response:
                        if response.status == 200:
                            return self
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError(f"the gateway did not become ready: {self.log()}")

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop(signal.SIGTERM)

    def stop(self, how: signal.Signals = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(how)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]
