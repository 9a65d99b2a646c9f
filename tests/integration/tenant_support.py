"""What the tenants' integration tests share: a worker with tenancy on, each test user (the
``tenant_users`` fixture, conftest.py) its own tenant."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from support_rpc import AMQP_URL

from contracts import topology as t
from harness import WorkerProcess
from worker.testing.scripted_model import ScriptedModel


def tenant_worker(
    model: ScriptedModel,
    users: dict[str, str],
    folder: Path,
    *agents: dict[str, Any],
    **env: str,
) -> WorkerProcess:
    """A worker with tenancy on, each user of ``users`` (tenant -> AMQP URL) its own tenant,
    running ``agents`` (default: ``support`` with no tools), with ``env`` besides."""
    path = folder / "agents.json"
    path.write_text(json.dumps({"agents": list(agents or [{"name": "support", "tools": []}])}))
    mapping = {url.split("//")[1].split(":")[0]: tenant for tenant, url in users.items()}
    settings = {
        "LOOPWIRE_TENANTS__ENABLED": "true",
        "LOOPWIRE_TENANTS__USERS": json.dumps(mapping),
        **env,
    }
    return WorkerProcess(model_url=model.base_url, agents_file=path, extra_env=settings)


def trusting_worker(model: ScriptedModel, agents: Path, tenants: tuple[str, ...]) -> WorkerProcess:
    """A worker with tenancy on that trusts the test's broker user to act for ``tenants`` (the
    gateway's way), each tenant's intake queue kept (a queue bound for a tenant that no worker
    consumes would hold its requests: docs/tenants.md)."""
    settings = {
        "LOOPWIRE_TENANTS__ENABLED": "true",
        "LOOPWIRE_TENANTS__INTAKE": json.dumps(list(tenants)),
    }
    return WorkerProcess(model_url=model.base_url, agents_file=agents, extra_env=settings)


def drop_intake_queues(tenants: tuple[str, ...]) -> None:
    """The tenants' intake queues (worker/transport/intake.py), which outlive the workers that
    consumed them: a later test's workers may keep none for these tenants."""
    vhost = unquote(urlsplit(AMQP_URL).path[1:]) or "/"
    for tenant in tenants:
        subprocess.run(
            ["rabbitmqctl", "-q", "delete_queue", "-p", vhost, t.intake_queue(tenant)],
            capture_output=True,
        )
