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

import aiohttp
from support_rpc import AMQP_URL, REDIS_URL

from gateway.http.keys import new_key
from harness import ROOT, free_port


class GatewayProcess:
    """``async with GatewayProcess(agents_file, {"acme": "acme", "plain": None}) as g``:
    ``g.url``, and ``g.keys[name]`` the API key of each named key (acting for its tenant)."""

    def __init__(
        self,
        agents_file: Path,
        tenants: dict[str, str | None],
        *,
        replica_of: GatewayProcess | None = None,
        **env: str,
    ) -> None:
        """``replica_of``: another replica, whose keys file this one serves too."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        folder = Path(tempfile.mkdtemp(prefix="loopwire-gateway-"))
        self.keys: dict[str, str] = {}
        entries = []
        for name, tenant in tenants.items():
            key, entry = new_key(name, tenant)
            self.keys[name] = key
            entries.append(entry.model_dump(exclude_none=True))
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
