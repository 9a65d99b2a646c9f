"""A local three-node RabbitMQ cluster for tests: three ``RabbitNode``s (``tests/integration/
nodes.py``: each its own ports, configuration, plugins file and directories, owned by the
``rabbitmq`` user) named ``lwc1@localhost`` .. ``lwc3@localhost``; the second and third join
the first (``stop_app``, ``join_cluster``, ``start_app``). The shared broker
(``rabbit@localhost``) is never part of it.

The cluster has a user of its own with a random password, so a test can check that the
password never appears in a log line. ``stop()`` halts every node it started, also after a
failed start. ``rabbit_cluster`` is the pytest fixture (one cluster per test module); it fails
(never skips) when ``rabbitmq-server`` is missing. ``scripts/rabbit-cluster`` starts one by
hand (``main``) and stops it on Enter.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.nodes import RabbitNode

NAMES = ("lwc1@localhost", "lwc2@localhost", "lwc3@localhost")
USER = "loopwire"


class RabbitCluster:
    """``start()`` boots and joins the nodes; ``urls`` are their AMQP addresses (node order)."""

    def __init__(self, names: tuple[str, ...] = NAMES) -> None:
        if shutil.which("rabbitmq-server") is None or shutil.which("rabbitmqctl") is None:
            raise RuntimeError("rabbitmq-server is not installed: the test cluster cannot start")
        self.nodes = [RabbitNode(name) for name in names]
        self.password = secrets.token_hex(12)
        self.boot_s = 0.0
        """How long ``start()`` took."""

    @property
    def urls(self) -> list[str]:
        return [f"amqp://{USER}:{self.password}@127.0.0.1:{n.port}/" for n in self.nodes]

    def node_of(self, port: int) -> RabbitNode:
        return next(n for n in self.nodes if n.port == port)

    def start(self) -> None:
        began = time.monotonic()
        self._stop_leftovers()
        try:
            with ThreadPoolExecutor(len(self.nodes)) as pool:
                list(pool.map(lambda node: node.start(timeout=120), self.nodes))
            first = self.nodes[0]
            for node in self.nodes[1:]:
                node.ctl("stop_app")
                node.ctl("join_cluster", first.name)
                node.start_app()
            first.ctl("add_user", USER, self.password)
            first.ctl("set_user_tags", USER, "administrator")
            first.ctl("set_permissions", "-p", "/", USER, ".*", ".*", ".*")
            running = self.running()
            if sorted(running) != sorted(n.name for n in self.nodes):
                raise RuntimeError(f"the cluster did not form: running nodes {running}")
        except BaseException:
            self.stop()
            raise
        self.boot_s = time.monotonic() - began

    def _stop_leftovers(self) -> None:
        """A node of these names still running is this suite's, left by a run that was killed
        before it could stop it: stop it, or the new node of the same name cannot start."""
        listed = subprocess.run(["epmd", "-names"], capture_output=True, text=True, check=False)
        for node in self.nodes:
            short = node.name.split("@", 1)[0]
            if f"name {short} at port" in listed.stdout:
                subprocess.run(
                    ["rabbitmqctl", "-q", "-n", node.name, "stop"],
                    capture_output=True,
                    timeout=60,
                    check=False,
                )

    def running(self) -> list[str]:
        """The running members, as the first node that answers sees them."""
        for node in self.nodes:
            try:
                status = json.loads(node.ctl("cluster_status", "--formatter", "json"))
            except (RuntimeError, ValueError):
                continue
            return list(status.get("running_nodes", []))
        return []

    def stop(self) -> None:
        for node in self.nodes:
            node.close()


@pytest.fixture(scope="module")
def rabbit_cluster() -> Iterator[RabbitCluster]:
    try:
        cluster = RabbitCluster()
        cluster.start()
    except RuntimeError as exc:
        pytest.fail(f"cannot start a local RabbitMQ cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


def main(argv: list[str]) -> int:
    """``start``: boot a cluster, print its URLs, stop it on Enter or Ctrl-C."""
    if argv[1:] != ["start"]:
        print("usage: scripts/rabbit-cluster", file=sys.stderr)
        return 2
    cluster = RabbitCluster()
    cluster.start()
    try:
        print(f"three nodes up in {cluster.boot_s:.1f}s")
        print("LOOPWIRE_AMQP_URLS=" + ",".join(cluster.urls), flush=True)
        input("press Enter to stop the cluster\n")
    except (KeyboardInterrupt, EOFError):
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
