"""The machine the numbers came from, and the tables printed at the end of a run."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from typing import Any

import aio_pika
from redis.asyncio import Redis

from tests.bench.budget import MIN_ROUNDS, Judged
from tests.bench.workload import AMQP_URL


def median(values: Sequence[float]) -> float:
    clean = [v for v in values if v == v]
    return statistics.median(clean) if clean else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


async def machine(redis: Redis) -> dict[str, Any]:
    lscpu = _run(["lscpu"]).splitlines()[:14]
    info = await redis.info("server")
    if "redis_version" not in info:  # a cluster client answers per node
        info = next(iter(info.values()), {})
    connection = await aio_pika.connect(AMQP_URL)
    try:
        props = connection.transport.connection.server_properties  # type: ignore[union-attr]
        rabbit = props.get("version", "?")
        rabbit = rabbit.decode() if isinstance(rabbit, bytes) else str(rabbit)
    finally:
        await connection.close()
    versions = {}
    for name in (
        "openai",
        "httpx2",
        "aiohttp",
        "aio-pika",
        "aiormq",
        "redis",
        "pydantic",
        "msgpack",
    ):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "-"
    return {
        "nproc": os.cpu_count(),
        "lscpu": lscpu,
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "rabbitmq": rabbit,
        "redis": info.get("redis_version", "?"),
        "packages": versions,
    }


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def targets_table(judged: Sequence[Judged]) -> str:
    """The performance budget's targets this run judged, each with its figure and verdict."""
    return table(
        f"Targets (DESIGN.md, performance budget; judged on medians of >= {MIN_ROUNDS} "
        "alternated rounds, the order reversed every round)",
        ("target", "figure", "rounds", "verdict"),
        [(j.target, j.value, j.rounds, j.verdict) for j in judged],
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    return str(value)
