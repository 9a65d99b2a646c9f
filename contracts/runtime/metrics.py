"""What every loopwire process exports about itself: ``loopwire_build_info`` with the process,
platform and GC collectors, and the histogram buckets that workers and tool services share."""

from __future__ import annotations

import platform
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Final

from prometheus_client import CollectorRegistry, Info
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

TOOL_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""Tool call durations, as the worker (caller) and the tool service (callee) both observe them."""


def package_version() -> str:
    try:
        return version("loopwire")
    except PackageNotFoundError:
        return "0+unknown"


def build_info(registry: CollectorRegistry, *, component: str, service: str) -> None:
    """``loopwire_build_info`` plus the process, platform and GC collectors, on ``registry``."""
    info = Info("loopwire_build", "The running loopwire build (value 1).", registry=registry)
    info.info(
        {
            "version": package_version(),
            "python_version": platform.python_version(),
            "component": component,
            "service": service,
        }
    )
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


def sample_names(registry: CollectorRegistry) -> Sequence[str]:
    """Every sample name ``registry`` can expose (``_total``, ``_bucket`` …), for config checks."""
    names: set[str] = set()
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
        "gauge": ("",),
    }
    for family in registry.collect():
        for suffix in suffixes.get(family.type, ("",)):
            names.add(family.name + suffix)
    return sorted(names)
