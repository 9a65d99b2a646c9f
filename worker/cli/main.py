"""The ``loopwire`` command line.

Errors are one readable line on stderr, ``error: ...``, naming the argument or the setting
at fault, with an exit code from ``worker.cli.exits`` (docs/operations.md lists them).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from worker.cli import exits
from worker.cli.connection import Connection, connection
from worker.cli.parser import build_parser

__all__ = ["build_parser", "main"]

QUIET = {"turn", "tail", "dlq", "cancel", "approvals", "approve", "reject", "session", "result"}
"""Commands whose client libraries' own log lines would duplicate the one-line errors."""

ACTS_FOR_NO_TENANT = {"worker", "tools", "agents", "schema", "demo", "gateway"}
"""Commands ``--tenant`` means nothing to (refused there): a worker takes each message's tenant
from the message, a tool service each call's; ``agents`` and ``schema`` reach no fleet, and
``demo`` runs a fleet of its own."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return exits.OK
    if args.command in QUIET:
        logging.basicConfig(level=logging.CRITICAL)
    from contracts.runtime.redis_client import RedisUnreachableError
    from contracts.runtime.tls import TlsConfigError
    from worker.errors import CliError, ConfigError

    try:
        code = _run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except CliError as exc:
        return _fail(str(exc), exc.code)
    except (ConfigError, TlsConfigError) as exc:  # settings or TLS files it cannot use
        return _fail(str(exc), exits.USAGE)
    except RedisUnreachableError as exc:  # names the address, never a password
        return _fail(str(exc), exits.ERROR)
    except BrokenPipeError:
        # the reader went away (``| head``): say nothing, and let no flush at exit fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return exits.CLOSED_PIPE
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return exits.INTERRUPTED


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"error: {message}\n")
    return code


def _run(args: argparse.Namespace) -> int:
    if args.command in ACTS_FOR_NO_TENANT and getattr(args, "tenant", None) is not None:
        from worker.errors import CliError

        raise CliError(f"--tenant: 'loopwire {args.command}' acts for no tenant", exits.USAGE)
    done = _without_connection(args)
    if done is not None:
        return done
    where = connection(args)
    if args.command == "mcp":
        from worker.cli.mcp import configure_logging, run_mcp_serve

        configure_logging(args.log_level)
        return asyncio.run(
            run_mcp_serve(
                amqp_url=where.amqp_url,
                tls=where.amqp_tls,
                agents_file=args.agents_file,
                transport=args.transport,
                host=args.host,
                port=args.port,
                path=args.path,
                timeout_s=args.timeout,
                remind_every_s=args.remind_every,
                metrics_port=args.metrics_port,
                tenant=where.tenant,
            )
        )
    if args.command in ("turn", "tail", "cancel"):
        return _turns(args, where)
    if args.command in ("approvals", "approve", "reject"):
        return _approvals(args, where)
    if args.command == "dlq":
        from worker.cli.dlq_command import run_dlq_command

        return run_dlq_command(args, where)
    from worker.cli.sessions import run_result_command, run_session_command

    if args.command == "result":
        return asyncio.run(
            run_result_command(
                amqp_url=where.amqp_url,
                tls=where.amqp_tls,
                turn_id=args.turn_id,
                as_json=args.json,
                tenant=where.tenant,
            )
        )
    return asyncio.run(
        run_session_command(
            amqp_url=where.amqp_url,
            tls=where.amqp_tls,
            command=args.session_command,
            session_id=args.session_id,
            as_json=args.json,
            yes=args.yes,
            limit=args.limit,
            tenant=where.tenant,
        )
    )


def _without_connection(args: argparse.Namespace) -> int | None:
    """The commands that read no connection settings of the command line; None: another."""
    if args.command == "tools" and args.tools_command == "mcp-check":
        from worker.cli import mcp_bridge

        return mcp_bridge.run(args)
    if args.command in ("worker", "tools"):
        return _process(args)
    if args.command == "agents":
        from worker.cli.agents import run_agents_command

        return run_agents_command(args.agents_command, args.file, as_json=args.json)
    if args.command == "gateway":
        from worker.cli.gateway import run_gateway_command

        _export(args)  # the gateway's settings read them
        return run_gateway_command(args)
    if args.command == "schema":
        from contracts.schema import write_schemas

        return write_schemas(args.out)
    if args.command == "demo":
        from worker.cli.demo import DEFAULT_QUESTION, WORKFLOW_QUESTION, run_demo

        _export(args)
        default = WORKFLOW_QUESTION if args.workflow else DEFAULT_QUESTION
        return asyncio.run(
            run_demo(args.question or default, workflow=args.workflow, over_http=args.http)
        )
    return None


def _export(args: argparse.Namespace) -> None:
    """The connection options given, as the variables a started process reads (checked
    first, so that a bad one is refused naming the option, not the variable)."""
    from worker.cli.connection import checked_options

    amqp_url, redis_url = checked_options(args)
    if amqp_url is not None:
        os.environ["LOOPWIRE_AMQP_URLS"] = amqp_url
    if redis_url is not None:
        os.environ["LOOPWIRE_REDIS_URL"] = redis_url
    if getattr(args, "redis_cluster", False):
        os.environ["LOOPWIRE_REDIS_CLUSTER"] = "true"


def _process(args: argparse.Namespace) -> int:
    _export(args)
    if args.command == "worker":
        from worker.app import main as worker_main

        return worker_main()
    # tool services are their own program (worker and tool_services never import each
    # other): this process becomes it, keeping its pid and signals
    os.execv(sys.executable, [sys.executable, "-m", "tool_services", args.name])


def _turns(args: argparse.Namespace, where: Connection) -> int:
    from worker.cli.turns import run_cancel_command, run_tail_command, run_turn_command

    if args.command == "turn":
        return asyncio.run(
            run_turn_command(
                amqp_url=where.amqp_url,
                tls=where.amqp_tls,
                text=args.text,
                agent=args.agent,
                session=args.session,
                follow=args.follow,
                as_json=args.json,
                timeout=args.timeout,
                max_iterations=args.max_iterations,
                deadline_s=args.deadline,
                stream=args.stream,
                tenant=where.tenant,
            )
        )
    if args.command == "cancel":
        return asyncio.run(
            run_cancel_command(
                amqp_url=where.amqp_url,
                tls=where.amqp_tls,
                turn_id=args.turn_id,
                reason=args.reason,
                session=args.session,
                by=args.by,
                tenant=where.tenant,
                rollback=args.rollback,
            )
        )
    return asyncio.run(
        run_tail_command(
            amqp_url=where.amqp_url,
            tls=where.amqp_tls,
            pattern=args.pattern,
            as_json=args.json,
            count=args.count,
            tree=args.tree,
            tenant=where.tenant,
        )
    )


def _approvals(args: argparse.Namespace, where: Connection) -> int:
    from worker.cli.approvals import decide, list_approvals

    if args.command == "approvals":
        return asyncio.run(
            list_approvals(
                redis_url=where.redis_url,
                as_json=args.json,
                cluster=where.redis_cluster,
                tls=where.redis_tls,
                tenant=where.tenant,
            )
        )
    return asyncio.run(
        decide(
            amqp_url=where.amqp_url,
            tls=where.amqp_tls,
            turn_id=args.turn_id,
            call_id=args.call_id,
            verdict=args.command,
            arguments=getattr(args, "arguments", None),
            message=args.message,
            by=args.by,
            tenant=where.tenant,
        )
    )
