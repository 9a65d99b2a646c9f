"""A local Redis Cluster for the tests: three masters with one replica each.

Six ``redis-server --cluster-enabled yes`` processes on free local ports (never 6379, and
with their cluster bus port, port + 10000, free too), data and logs in a temporary
directory, no persistence; ``redis-cli --cluster create … --cluster-replicas 1`` joins them;
ready once every node says ``cluster_state:ok``, agrees on the slot map and every replica's
link to its master is up. Stopping is ``SHUTDOWN NOSAVE NOW`` on each node and removing the
directory.

``redis_cluster`` is the pytest fixture (one cluster per test module; import
``redis_cluster_fixture`` into the module); it fails, never skips,
when ``redis-server`` or ``redis-cli`` is missing. ``python -m tests.cluster.redis_cluster``
starts one by hand and prints its URL (Ctrl-C or SIGTERM stops it).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis.crc import key_slot

NODE_TIMEOUT_MS = 2000
"""How long a master may be unreachable before the others fail it over (the default is 15 s)."""


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_ports(n: int) -> list[int]:
    """``n`` ports whose cluster bus ports (port + 10000) are free too."""
    found: list[int] = []
    while len(found) < n:
        port = random.randint(20_000, 45_000)
        if port not in found and _port_free(port) and _port_free(port + 10_000):
            found.append(port)
    return found


class RedisClusterError(RuntimeError):
    pass


class LocalRedisCluster:
    """``start()`` / ``stop()``; ``url`` names every master as a seed node."""

    def __init__(self, masters: int = 3, replicas: int = 1) -> None:
        self.masters = masters
        self.replicas = replicas
        self.ports = free_cluster_ports(masters * (1 + replicas))
        self.dir = Path(tempfile.mkdtemp(prefix="loopwire-redis-cluster-"))

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{p}" for p in self.ports[: self.masters])
        return f"redis+cluster://{seeds}/"

    # -- lifecycle --------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> None:
        for tool in ("redis-server", "redis-cli"):
            if shutil.which(tool) is None:
                raise RedisClusterError(f"{tool} is not installed (apt-get install redis-server)")
        try:
            for port in self.ports:
                self._start_node(port)
            self._wait(lambda: all(self._answers(p) for p in self.ports), timeout, "nodes up")
            subprocess.run(
                ["redis-cli", "--cluster", "create"]
                + [f"127.0.0.1:{p}" for p in self.ports]
                + ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
                capture_output=True,
                check=True,
                timeout=timeout,
            )
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def _start_node(self, port: int) -> None:
        node = self.dir / str(port)
        node.mkdir(exist_ok=True)  # a restarted node keeps its nodes.conf: it rejoins
        subprocess.run(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(node / "nodes.conf"),
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                "--dir",
                str(node),
                "--daemonize",
                "yes",
                "--pidfile",
                str(node / "redis.pid"),
                "--logfile",
                str(node / "redis.log"),
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )

    def stop(self) -> None:
        for port in self.ports:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.cli(port, "shutdown", "nosave", "now", timeout=10)
        for port in self.ports:  # a node that did not answer: its pid
            pidfile = self.dir / str(port) / "redis.pid"
            with contextlib.suppress(OSError, ValueError):
                pid = int(pidfile.read_text())
                for _ in range(50):
                    Path(f"/proc/{pid}").stat()
                    time.sleep(0.1)
                subprocess.run(["kill", "-9", str(pid)], check=False, capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- looking and poking -----------------------------------------------------------------

    def cli(self, port: int, *args: str, timeout: float = 10) -> str:
        done = subprocess.run(
            ["redis-cli", "-p", str(port), *args],
            capture_output=True,
            check=True,
            timeout=timeout,
            text=True,
        )
        return done.stdout.strip()

    def _answers(self, port: int) -> bool:
        try:
            return self.cli(port, "ping", timeout=2) == "PONG"
        except (subprocess.SubprocessError, OSError):
            return False

    def info(self, port: int, section: str) -> dict[str, str]:
        lines = self.cli(port, "info", section).splitlines()
        return dict(line.split(":", 1) for line in lines if ":" in line)

    def nodes(self, port: int) -> list[list[str]]:
        """``CLUSTER NODES`` as seen from ``port``, one split line per node."""
        return [line.split() for line in self.cli(port, "cluster", "nodes").splitlines()]

    def master_ports(self) -> list[int]:
        """The ports of the masters serving slots now."""
        return sorted(
            int(f[1].split(":")[1].split("@")[0])
            for f in self.nodes(self.ports[0])
            if "master" in f[2] and "fail" not in f[2] and len(f) > 8
        )

    def master_of_slot(self, slot: int, port: int | None = None) -> int:
        for fields in self.nodes(port or self.ports[0]):
            if "master" not in fields[2] or "fail" in fields[2]:
                continue
            for spec in fields[8:]:
                low, _, high = spec.partition("-")
                if not low.isdigit():
                    continue
                if int(low) <= slot <= int(high or low):
                    return int(fields[1].split(":")[1].split("@")[0])
        raise RedisClusterError(f"no master serves slot {slot}")

    def master_of(self, key: str) -> int:
        """The port of the master that owns ``key``'s slot."""
        return self.master_of_slot(key_slot(key.encode()))

    def replica_of(self, master_port: int) -> int:
        nodes = self.nodes(master_port)
        master_id = next(f[0] for f in nodes if "myself" in f[2])
        for fields in nodes:
            if fields[3] == master_id and "fail" not in fields[2]:
                return int(fields[1].split(":")[1].split("@")[0])
        raise RedisClusterError(f"the master on {master_port} has no replica")

    def failover(self, master_port: int, timeout: float = 30) -> int:
        """A manual failover (``CLUSTER FAILOVER`` on the master's replica, which waits for
        the replica to catch up: nothing acknowledged is lost); the new master's port, once it
        serves (``wait_healthy`` then waits for the old master to follow it as a replica)."""
        replica = self.replica_of(master_port)
        self.cli(replica, "cluster", "failover")
        self._wait(
            lambda: self.info(replica, "replication").get("role") == "master",
            timeout,
            f"{replica} promoted",
        )
        return replica

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port``, as a crash would."""
        pid = int((self.dir / str(port) / "redis.pid").read_text())
        subprocess.run(["kill", "-9", str(pid)], check=True, capture_output=True)
        self._wait(lambda: not self._answers(port), 10, f"{port} down")

    def promoted(self, replica: int, timeout: float = 30) -> None:
        """Wait until ``replica`` is a master (its dead master failed over after
        ``NODE_TIMEOUT_MS``) and the cluster serves every slot again."""

        def serving() -> bool:
            cluster_info = self.cli(replica, "cluster", "info")
            return (
                self.info(replica, "replication").get("role") == "master"
                and "cluster_state:ok" in cluster_info
            )

        self._wait(serving, timeout, f"{replica} promoted")

    def restart(self, port: int, timeout: float = 60) -> None:
        """Start a killed node again: it rejoins as a replica of whoever took its slots."""
        self._start_node(port)
        self.wait_healthy(timeout)

    def healthy(self) -> bool:
        views = set()
        for port in self.ports:
            if not self._answers(port):
                return False
            if self.info(port, "cluster").get("cluster_enabled") != "1":
                return False
            if "cluster_state:ok" not in self.cli(port, "cluster", "info"):
                return False
            if self.info(port, "replication").get("role") == "slave" and (
                self.info(port, "replication").get("master_link_status") != "up"
            ):
                return False
            masters = sorted(
                (f[1], " ".join(f[8:]))
                for f in self.nodes(port)
                if "master" in f[2] and "fail" not in f[2]
            )
            views.add(tuple(masters))
        return len(views) == 1

    def wait_healthy(self, timeout: float = 60) -> None:
        self._wait(self.healthy, timeout, "cluster_state:ok on every node, one slot map")

    @staticmethod
    def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except (subprocess.SubprocessError, OSError, StopIteration, RedisClusterError):
                pass
            time.sleep(0.1)
        raise RedisClusterError(f"the Redis Cluster did not get there in {timeout}s: {what}")


@pytest.fixture(scope="module", name="redis_cluster")
def redis_cluster_fixture() -> Iterator[LocalRedisCluster]:
    """A started three-master Redis Cluster with one replica each, stopped after the module."""
    cluster = LocalRedisCluster()
    try:
        cluster.start()
    except (RedisClusterError, subprocess.SubprocessError, OSError) as exc:
        pytest.fail(f"cannot start a local Redis Cluster: {exc!r}")
    try:
        yield cluster
    finally:
        cluster.stop()


def main() -> None:
    cluster = LocalRedisCluster()
    cluster.start()
    print(cluster.url, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
