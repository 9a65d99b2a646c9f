"""``loopwire gateway serve``: the HTTP gateway (``gateway.http``) over the fleet, and
``loopwire gateway key``: a new API key and its line for the keys file.

This module is the command's half that knows the worker's agent profiles: it reads the agents
file (as ``loopwire agents`` does) and hands the gateway a plain list of assistants; the
gateway imports ``contracts`` only. The files are read once, at start: restart to change them.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from contracts.runtime import event_loop
from contracts.runtime.amqp import resolve_urls
from contracts.runtime.loading import SettingsError, load, sentence
from contracts.runtime.metrics import build_info
from contracts.runtime.redis_client import RedisUnreachableError, check, redis_client
from gateway.console import Console
from gateway.http.app import Gateway
from gateway.http.fleet import Fleet
from gateway.http.keys import ApiKeys, new_key
from gateway.http.settings import GatewaySettings
from gateway.http.webhooks import Webhooks
from worker.cli import exits
from worker.errors import CliError
from worker.profiles.agents import AgentProfiles

log = logging.getLogger("loopwire.gateway")


INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "object",
                        "required": ["content"],
                        "properties": {
                            "role": {"const": "user"},
                            "type": {"const": "human"},
                            "content": {"type": ["string", "array"]},
                        },
                    },
                ]
            },
        }
    },
}
"""What a run's ``input`` is: the user's messages (gateway.http.shapes.input_texts)."""


def assistants(path: Path) -> list[dict[str, Any]]:
    """The agents and workflows of the agents file, as the Agent Protocol's assistants."""
    try:
        profiles = AgentProfiles.load(path)
    except (OSError, ValueError) as exc:  # ValidationError and JSONDecodeError are ValueErrors
        raise CliError(f"agents file {path}: {exc}", code=exits.USAGE) from None
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(path.stat().st_mtime))
    found = []
    for agent in profiles.agents:
        kind = "workflow" if agent.workflow is not None else "agent"
        structured = agent.output_schema if agent.workflow is None else None
        found.append(
            {
                "input_schema": INPUT_SCHEMA,
                "output_schema": structured,
                "assistant_id": agent.name,
                "graph_id": agent.name,
                "name": agent.name,
                "description": agent.description,
                "config": {},
                "context": {},
                "metadata": {"kind": kind},
                "version": 1,
                "created_at": now,
                "updated_at": now,
            }
        )
    return found


def settings(overrides: dict[str, Any]) -> GatewaySettings:
    try:
        loaded = load(GatewaySettings)
    except SettingsError as exc:
        raise CliError(str(exc), exits.USAGE) from None
    options = loaded.gateway.model_copy(
        update={k: v for k, v in overrides.items() if v is not None}
    )
    return loaded.model_copy(update={"gateway": options})


async def run_gateway_serve(s: GatewaySettings) -> int:
    import uvicorn

    g = s.gateway
    if g.keys_file is None:
        raise CliError(
            "no API keys: give --keys-file or set LOOPWIRE_GATEWAY__KEYS_FILE", exits.USAGE
        )
    try:
        keys = ApiKeys.load(g.keys_file)
    except ValidationError as exc:
        said = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'the file'}: {sentence(e['msg'])}"
            for e in exc.errors(include_url=False, include_input=False)
        )
        raise CliError(f"keys file {g.keys_file}: {said}", exits.USAGE) from None
    except (OSError, ValueError) as exc:
        raise CliError(f"keys file {g.keys_file}: {exc}", exits.USAGE) from None
    agents_file = g.agents_file or s.agents_file
    if agents_file is None:
        raise CliError(
            "no agents file: give --agents-file or set LOOPWIRE_AGENTS_FILE", exits.USAGE
        )
    offered = assistants(agents_file)
    redis = redis_client(s.redis_url, cluster=s.redis_cluster, tls=s.redis_tls)
    try:
        await check(redis, s.redis_url)
    except RedisUnreachableError as exc:
        raise CliError(str(exc)) from None
    registry = CollectorRegistry()
    build_info(registry, component="gateway", service="gateway")
    fleet = Fleet(resolve_urls(url=s.amqp_url, urls=s.amqp_urls), s.amqp_tls)
    hooks = None
    if g.webhook_secret is not None:
        try:
            hooks = Webhooks(
                redis,
                secret=g.webhook_secret.get_secret_value(),
                allow=g.webhook_allow,
                ttl_s=s.state_ttl_s,
                attempts=g.webhook_attempts,
                timeout_s=g.webhook_timeout_s,
            )
        except Exception as exc:  # the library's own error for a secret it cannot use
            raise CliError(f"LOOPWIRE_GATEWAY__WEBHOOK_SECRET: {exc}", exits.USAGE) from None
    console = None
    if g.console:
        console = Console(
            keys=keys,
            fleet=fleet,
            redis=redis,
            ttl_s=s.state_ttl_s,
            list_size=g.console_list_size,
            trace_url=g.trace_url,
        )
    gateway = Gateway(
        console=console,
        fleet=fleet,
        redis=redis,
        keys=keys,
        assistants=offered,
        ttl_s=s.state_ttl_s,
        max_body_bytes=g.max_body_bytes,
        wait_timeout_s=g.wait_timeout_s,
        registry=registry,
        webhooks=hooks,
    )
    log.info("serving %d assistant(s) on http://%s:%d", len(offered), g.host, g.port)
    config = uvicorn.Config(
        gateway.app(),
        host=g.host,
        port=g.port,
        log_level="warning",
        access_log=False,  # the metrics count requests; a log line each would cost more
        http="httptools",  # the C parser (uvicorn's standard extra), not the pure-Python h11
    )
    try:
        await uvicorn.Server(config).serve()
    finally:
        await fleet.close()
        await redis.aclose()
    return 0


def run_gateway_command(args: argparse.Namespace) -> int:
    """``gateway key`` or ``gateway serve`` (its options over the settings)."""
    if args.gateway_command == "key":
        return run_gateway_key(args.name, args.key_tenant)
    overrides = {n: getattr(args, n) for n in ("host", "port", "keys_file", "agents_file")}
    loaded = settings(overrides)
    return event_loop.run(run_gateway_serve(loaded), loaded.event_loop)


def run_gateway_key(name: str, tenant: str | None) -> int:
    key, entry = new_key(name, tenant)
    print(f"key (give it to the client; it is shown once): {key}")
    print('line for the keys file\'s "keys" list:')
    print(json.dumps(entry.model_dump(exclude_none=True)))
    return 0
