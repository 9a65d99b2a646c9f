"""``loopwire dlq list [--json]`` and ``loopwire dlq replay ID`` (``worker.cli.dlq`` does the
work)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys

from contracts.runtime.amqp import AmqpUnreachableError
from worker.cli import exits
from worker.cli.connection import Connection
from worker.cli.dlq import list_dead, replay
from worker.errors import CliError


def run_dlq_command(args: argparse.Namespace, where: Connection) -> int:
    try:
        if args.dlq_command == "list":
            dead = asyncio.run(list_dead(where.amqp_url, where.amqp_tls, where.tenant))
            for d in dead:
                if args.json:
                    sys.stdout.write(json.dumps(dataclasses.asdict(d), sort_keys=True) + "\n")
                    continue
                tenant = f"tenant={d.tenant}  " if d.tenant is not None else ""
                sys.stdout.write(
                    f"{d.id}  {d.code:<14} turn={d.turn_id or '-'}  {tenant}{d.kind}  "
                    f"{d.size} B  {d.reason}\n"
                )
            if not dead and not args.json:
                sys.stdout.write(
                    "the dead-letter queue is empty\n"
                    if where.tenant is None
                    else f"the dead-letter queue holds no letter of tenant {where.tenant}\n"
                )
            return exits.OK
        found = asyncio.run(replay(where.amqp_url, args.id, where.amqp_tls, where.tenant))
    except AmqpUnreachableError as exc:  # names each address and why
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"lost RabbitMQ: {exc or type(exc).__name__}") from None
    if found is None:
        raise CliError(
            f"no dead-lettered message with id {args.id!r} (see 'loopwire dlq list')",
            exits.NOT_FOUND,
        )
    sys.stdout.write(f"replayed {found.id} (turn {found.turn_id or '-'}) to the turn queue\n")
    return exits.OK
