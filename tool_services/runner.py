"""Run a tool service as a process: ``serve(name)``, ``python -m tool_services.<name>``.

``serve("search")`` imports ``tool_services.search`` and calls its
``create_service()``; a dotted name (``serve("mypkg.tools")``) imports that
module instead, so user services run the same way. The factory is called when
the process starts, never at import time.

With ``LOOPWIRE_TOOLS__HTTP_PORT`` set (the container image sets 9465) the
process serves ``/livez`` (the event loop answers), ``/readyz`` (consumers
registered, broker connected, Redis answers) and ``/metrics`` (its own
registry: ``tool_services.metrics`` plus build and process info) there.

Exit codes: 0 after SIGTERM/SIGINT (in-flight calls drained within
``grace_s``; a call still running then is cancelled, left unacked for another
instance, and logged), 1 when the service cannot start (broker or Redis
unreachable), 2 for an unknown service name or a setting that cannot be used (named).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import pkgutil
import re
import signal
import sys
from collections.abc import Callable
from typing import cast

from prometheus_client import CollectorRegistry

from contracts.runtime.health import HealthServer
from contracts.runtime.loading import SettingsError, load
from contracts.runtime.metrics import build_info
from contracts.runtime.tracer_setup import start_tracing
from tool_services.metrics import ToolServiceMetrics
from tool_services.sdk import ToolService
from tool_services.server import ToolServer
from tool_services.settings import Settings

log = logging.getLogger("loopwire.tool_services")

ServiceFactory = Callable[[], ToolService]


def serve(name: str, *, settings: Settings | None = None) -> int:
    """Run the named tool service until SIGTERM/SIGINT; return the process exit code."""
    if settings is None:
        try:
            settings = load(Settings)
        except SettingsError as exc:  # before logging is set up: one line, naming the variable
            sys.stderr.write(f"error: {exc}\n")
            return 2
    _configure_logging(settings)
    try:
        factory = load_factory(name)
    except LookupError as exc:
        log.error("%s", exc)
        return 2
    return serve_service(factory, settings=settings)


def serve_service(
    service: ToolService | ServiceFactory, *, settings: Settings | None = None
) -> int:
    """Run ``service`` (or build it with the factory, at start) until SIGTERM/SIGINT."""
    settings = settings or Settings()
    _configure_logging(settings)
    try:
        asyncio.run(run_service(service, settings))
    except StartError as exc:
        log.error("%s", exc)
        return 1
    return 0


class StartError(RuntimeError):
    """The service could not start (its broker or Redis is unreachable, or the topology clashes)."""


async def run_service(
    service: ToolService | ServiceFactory,
    settings: Settings,
    *,
    stop: asyncio.Event | None = None,
    registry: CollectorRegistry | None = None,
) -> bool:
    """Serve until ``stop`` is set (by default: SIGTERM or SIGINT); True when fully drained."""
    built = service if isinstance(service, ToolService) else service()
    registry = registry or CollectorRegistry()
    build_info(registry, component="tool_service", service=built.name)
    metrics = ToolServiceMetrics(registry, tools=built.tools)
    provider = start_tracing(f"loopwire-tool-{built.name}")
    tracer = provider.get_tracer("loopwire.tool_service") if provider is not None else None
    server = ToolServer(built, settings, metrics=metrics, tracer=tracer)
    health: HealthServer | None = None
    if settings.tools.http_port:
        health = HealthServer(
            registry=registry,
            checks={"consumer": server.consuming, "redis": server.redis_answers},
            port=settings.tools.http_port,
        )
    try:
        if health is not None:
            await health.start()
        await server.start()
    except Exception as exc:
        if health is not None:
            await health.stop()
        await built.shutdown()
        raise StartError(
            f"tool service {built.name!r} could not start: {type(exc).__name__}: {exc}"
        ) from exc
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            break
    try:
        await stop.wait()
        log.info("stopping tool service %s", built.name)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        drained = await server.stop()
        if health is not None:
            await health.stop()
        if provider is not None:
            provider.shutdown()  # exports what is still batched
    log.info("tool service %s stopped%s", built.name, "" if drained else " (calls cancelled)")
    return drained


def load_factory(name: str) -> ServiceFactory:
    """``create_service`` of ``tool_services.<name>`` (or of the dotted module ``name``)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", name):
        raise LookupError(f"invalid tool service name {name!r}")
    module_name = name if "." in name else f"tool_services.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise
        raise LookupError(
            f"unknown tool service {name!r}; built in: {', '.join(available())}"
        ) from None
    factory = getattr(module, "create_service", None)
    if not callable(factory):
        raise LookupError(f"{module_name} has no create_service() factory")
    return cast(ServiceFactory, factory)


def available() -> list[str]:
    """The built-in example services."""
    import tool_services

    return sorted(m.name for m in pkgutil.iter_modules(tool_services.__path__) if m.ispkg)


def _configure_logging(settings: Settings) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=settings.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s %(message)s",
        )
