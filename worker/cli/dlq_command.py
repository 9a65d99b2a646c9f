"""``loopwire dlq list [--json]``, ``loopwire dlq replay ID`` and ``loopwire dlq purge ID|--all``
(``contracts.dead_letters`` does the work, for the console too)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys

from contracts.dead_letters import NotReplayableError as NotReplayable
from contracts.dead_letters import list_dead, purge, replay
from contracts.runtime.amqp import AmqpUnreachableError
from worker.cli import exits
from worker.cli.connection import Connection
from worker.errors import CliError, NotReplayableError


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
        if args.dlq_command == "purge":
            return _purge(args, where)
        found = asyncio.run(replay(where.amqp_url, args.id, where.amqp_tls, where.tenant))
    except NotReplayable as exc:
        raise NotReplayableError(str(exc)) from None
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


def _purge(args: argparse.Namespace, where: Connection) -> int:
    if (args.id is None) == (not args.all):
        raise CliError("name one letter's id, or --all", exits.USAGE)
    removed = asyncio.run(purge(where.amqp_url, args.id, where.amqp_tls, where.tenant))
    if args.id is not None and not removed:
        raise CliError(
            f"no dead-lettered message with id {args.id!r} (see 'loopwire dlq list')",
            exits.NOT_FOUND,
        )
    for letter in removed:
        sys.stdout.write(f"purged {letter.id} (turn {letter.turn_id or '-'}, {letter.code})\n")
    if not removed:
        sys.stdout.write("nothing to purge\n")
    return exits.OK
