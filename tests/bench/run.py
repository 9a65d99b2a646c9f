"""Run the benchmark suite: ``python -m tests.bench [--quick] [--scenario NAME ...]``.

Needs RabbitMQ and Redis (``LOOPWIRE_AMQP_URL``, ``LOOPWIRE_REDIS_URL``; defaults: the vhost
``lw_bench`` and Redis database 3 on localhost). Give it a vhost of its own: it purges the turn
and tool queues of its vhost. Its Redis keys carry the run's id and are deleted at the end. Starts its own processes: the bench model
server, the floor worker and raw tool responder, loopwire workers and the calculator tool
service. Prints tables and writes ``tests/bench/results/bench-<time>.json``.

Scenarios (all by default, in this order):

- ``adapter``: one model call on each ``openai`` client path vs a plain aiohttp POST;
- ``rpc``: one tool call round trip, loopwire's ``ToolRPC`` + SDK service vs raw aio-pika;
- ``tool``: a tool service's CPU per call at a fixed call rate, the SDK's calculator service vs
  the tool protocol floor (``tests.bench.tool_floor``: the same idempotency bookkeeping from the
  raw libraries only);
- ``step``: worker CPU per step at 32 and 256 concurrent sessions: the floor, the protocol floor
  (``tests.bench.floor_protocol``: the floor making every operation the design requires) and
  loopwire;
- ``long``: steps 1-5 against the last five steps of the same 50-step turns (4 KB and 16 KB
  tool results, 32 sessions), loopwire and the protocol floor: worker CPU, bytes written to and
  read from Redis per step, the stored state's size (``--long-steps 10,25,50,100``: a curve of
  turn lengths; ``--long-results``: the result sizes);
- ``concurrency``: 2,000 turns in flight on one worker with a model answering after 2 s;
- ``scaling``: one worker vs two on the same load;
- ``tenants``: the noisy neighbour: tenant A publishes a backlog of turns at once (0, 100,
  1,000; quick 0, 100), tenant B then one, with each tenant's running turns capped: B's wait
  to its start and result, A's drain, the worker CPU per A turn ahead of B
  (``tests.bench.tenants``; needs ``rabbitmqctl`` to create the tenants' users).

``--quick`` (the CI smoke run, about a minute and a half) runs every scenario but ``tool`` once
at a small scale. The exit status is 1 when a turn failed or finished wrong (never for slow
numbers: the machines are shared and noisy; compare ratios, not absolute times).

The step, concurrency and tool scenarios print the performance budget's targets next to their
figures (``tests.bench.budget``), judged only on three rounds or more, and the run ends with a
table of them; the JSON result carries them under ``targets``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.bench.load import Driver
from tests.bench.report import machine, targets_table
from tests.bench.scenarios import FULL, NOT_QUICK, QUICK, SCENARIOS, Context
from tests.bench.targets import ModelServer, Shared
from tests.bench.workload import AMQP_URL, REDIS_URL

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small, fast smoke run (CI)")
    parser.add_argument(
        "--scenario",
        action="append",
        choices=sorted(SCENARIOS),
        help="run only these scenarios (repeatable); default: all",
    )
    parser.add_argument("--rounds", type=int, help="alternated rounds per measurement")
    parser.add_argument(
        "--long-steps",
        type=_int_list,
        help="turn lengths of the long scenario, e.g. 10,25,50,100 (default 50; quick 12)",
    )
    parser.add_argument(
        "--long-results",
        type=_int_list,
        help="tool result sizes of the long scenario in bytes (default 4096,16384; quick 4096)",
    )
    parser.add_argument(
        "--tenant-backlogs",
        type=lambda text: _int_list(text, least=0),
        help="tenant A's backlogs of the tenants scenario, e.g. 0,1000,3000 (default 0,100,1000)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON result")
    parser.add_argument(
        "--profile", type=Path, help="run the worker processes under cProfile, stats in this dir"
    )
    parser.add_argument(
        "--source",
        type=Path,
        help="run loopwire workers from this source tree (e.g. a baseline copy) instead",
    )
    return parser.parse_args(argv)


def _int_list(text: str, least: int = 1) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of whole numbers: {text!r}") from None
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"not a list of numbers of at least {least}: {text!r}")
    return values


async def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = QUICK if args.quick else FULL
    changes: dict[str, Any] = {}
    if args.rounds:
        changes["rounds"] = args.rounds
    if args.long_steps:
        changes["long_steps"] = args.long_steps
    if args.long_results:
        changes["long_results"] = args.long_results
    if args.tenant_backlogs:
        changes["tenant_backlogs"] = args.tenant_backlogs
    if changes:
        plan = type(plan)(**{**plan.__dict__, **changes})
    names = args.scenario or [n for n in SCENARIOS if not (args.quick and n in NOT_QUICK)]
    run_id = uuid.uuid4().hex[:6]
    shared = Shared()
    try:
        await shared.start()
    except Exception as exc:
        await shared.close()
        raise SystemExit(
            f"cannot use RabbitMQ at {AMQP_URL} or Redis at {REDIS_URL}: {exc!r}\n"
            "The suite needs a vhost of its own (it purges the turn and tool queues of its vhost): "
            "create it (rabbitmqctl add_vhost lw_bench; rabbitmqctl set_permissions -p lw_bench "
            "guest '.*' '.*' '.*') or point LOOPWIRE_AMQP_URL / LOOPWIRE_REDIS_URL elsewhere."
        ) from None
    model = ModelServer()
    started = time.time()
    result: dict[str, Any] = {
        "run_id": run_id,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "mode": "quick" if args.quick else "full",
        "plan": plan.__dict__,
        "machine": await machine(shared.redis),
        "scenarios": {},
    }
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    try:
        await model.start()
        driver = Driver(shared, model, run_id)
        await driver.start()
        ctx = Context(
            plan=plan,
            shared=shared,
            model=model,
            driver=driver,
            run_id=run_id,
            profile_dir=args.profile,
            source=args.source,
        )
        for name in names:
            print(f"[bench] {name} ...", flush=True)
            t0 = time.monotonic()
            result["scenarios"][name] = await SCENARIOS[name](ctx)
            print(f"[bench] {name} done in {time.monotonic() - t0:.0f}s", flush=True)
        result["targets"] = [j.as_dict() for j in ctx.judged]
        if ctx.judged:
            ctx.tables.append(targets_table(ctx.judged))
        result["tables"] = ctx.tables
    finally:
        model.stop()
        model.proc.remove_log()
        await Driver(shared, model, run_id).cleanup()
        await shared.close()
    result["seconds"] = round(time.time() - started, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    m = result["machine"]
    print()
    print(
        f"machine: {m['nproc']} vCPU, {next((line for line in m['lscpu'] if 'Model name' in line), '?')}, "
        f"RabbitMQ {m['rabbitmq']}, Redis {m['redis']}, Python {m['python']}"
    )
    for text in result.get("tables", []):
        print()
        print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}-{result['mode']}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"\n[bench] {result['seconds']}s; results in {path}")
    problems = list(_unhealthy(result["scenarios"]))
    for problem in problems:
        print(f"[bench] FAILED: {problem}")
    return 1 if problems else 0


def _unhealthy(node: Any, where: str = "") -> Iterator[str]:
    """Turns that failed or came back wrong anywhere in the results (numbers are not judged)."""
    if isinstance(node, dict):
        health = node.get("health")
        if isinstance(health, dict):
            bad = {k: v for k, v in health.items() if k != "transient_retries" and v}
            if bad:
                yield f"{where}: {bad}"
        for key, value in node.items():
            yield from _unhealthy(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _unhealthy(value, f"{where}[{i}]")
