"""The ``loopwire`` command line.

Errors are one readable line on stderr with a non-zero exit code; see
``worker.cli.turns`` for the exit codes of ``turn``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contracts.runtime.tls import TlsSettings

DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def _env_flag(name: str) -> bool:
    """A boolean environment variable, read as the processes' settings read it."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loopwire", description="Queue-native runtime for LLM agent loops."
    )
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("LOOPWIRE_AMQP_URLS")
        or os.environ.get("LOOPWIRE_AMQP_URL", DEFAULT_AMQP),
        help="RabbitMQ URL, or one per cluster node, comma-separated (default: "
        "$LOOPWIRE_AMQP_URLS, $LOOPWIRE_AMQP_URL or %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("worker", help="run a worker (configured by LOOPWIRE_* variables)")
    tools = sub.add_parser("tools", help="tool services")
    tools_sub = tools.add_subparsers(dest="tools_command", metavar="COMMAND", required=True)
    serve = tools_sub.add_parser("serve", help="run the tool service NAME (tool_services.NAME)")
    serve.add_argument("name", help="search, calculator, notes, or a module path")

    turn = sub.add_parser("turn", help="send a turn and print the answer")
    turn.add_argument("text", help="the user's message")
    turn.add_argument("--agent", "-a", default="default", help="agent name (default: %(default)s)")
    turn.add_argument("--session", "-s", default=None, help="session id (default: a new session)")
    turn.add_argument("--follow", "-f", action="store_true", help="print every event as it happens")
    turn.add_argument("--json", action="store_true", help="JSON lines instead of text")
    turn.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait (default: %(default)s)"
    )
    turn.add_argument(
        "--max-iterations", type=int, default=None, help="override max_tool_iterations"
    )
    turn.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the turn's deadline, from now: past it, it ends as cancelled",
    )
    turn.add_argument(
        "--stream",
        action="store_true",
        help="stream the answer: print its text as the model writes it",
    )

    cancel = sub.add_parser("cancel", help="cancel a turn wherever it is (turn.cancel)")
    cancel.add_argument("turn_id", help="the turn's id")
    cancel.add_argument("--reason", default="cancelled", help="why (the result's stopped_by)")
    cancel.add_argument("--session", default=None, help="its session id (saves a lookup)")
    cancel.add_argument("--by", default=None, help="who asks (for the log)")

    approvals = sub.add_parser("approvals", help="list the tool calls waiting for a decision")
    approvals.add_argument(
        "--redis-url",
        default=os.environ.get("LOOPWIRE_REDIS_URL", DEFAULT_REDIS),
        help="Redis URL (default: $LOOPWIRE_REDIS_URL or %(default)s); "
        "redis+cluster://host1:port,host2:port/ for a Redis Cluster",
    )
    approvals.add_argument(
        "--redis-cluster",
        action="store_true",
        default=_env_flag("LOOPWIRE_REDIS_CLUSTER"),
        help="the URL names a Redis Cluster node (default: $LOOPWIRE_REDIS_CLUSTER)",
    )
    approvals.add_argument("--json", action="store_true", help="JSON lines instead of text")
    for verb, what in (("approve", "approve (or, with --arguments, edit)"), ("reject", "reject")):
        decide = sub.add_parser(verb, help=f"{what} a tool call a turn waits on")
        decide.add_argument("turn_id", help="the turn's id")
        decide.add_argument("call_id", help="the call's id (from 'loopwire approvals')")
        decide.add_argument("--by", default=None, help="who decides")
        decide.add_argument("--message", default=None, help="for the model (with a rejection)")
        if verb == "approve":
            decide.add_argument(
                "--arguments", default=None, help="run the call with these (a JSON object)"
            )

    tail = sub.add_parser("tail", help="print events matching a routing-key pattern")
    tail.add_argument("pattern", nargs="?", default="#", help="e.g. 'tool.invoked.#' (default: #)")
    tail.add_argument("--json", action="store_true", help="JSON lines instead of text")
    tail.add_argument("--count", type=int, default=None, help="exit after this many events")
    tail.add_argument(
        "--tree", metavar="TURN_ID", default=None, help="a turn's events and its child turns'"
    )

    dlq = sub.add_parser("dlq", help="dead-lettered work")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", metavar="COMMAND", required=True)
    dlq_sub.add_parser("list", help="list dead-lettered messages with their reasons")
    replay = dlq_sub.add_parser(
        "replay", help="send a dead-lettered message back to the turn queue"
    )
    replay.add_argument("id", help="the id shown by 'loopwire dlq list'")

    demo = sub.add_parser("demo", help="run one real turn through a worker and the example tools")
    demo.add_argument("question", nargs="?", default=None, help="what to ask")
    demo.add_argument(
        "--workflow",
        action="store_true",
        help="run the triage workflow: a classifier routes to agents, one of which asks another",
    )

    session = sub.add_parser("session", help="a session: its summary, history, deletion")
    session_sub = session.add_subparsers(dest="session_command", metavar="COMMAND", required=True)
    for verb, what in (
        ("show", "its summary and turns"),
        ("history", "its newest messages"),
        ("delete", "delete it (its turns cancelled first)"),
    ):
        one = session_sub.add_parser(verb, help=what)
        one.add_argument("session_id", help="the session's id")
        one.add_argument("--json", action="store_true", help="JSON instead of text")
        one.add_argument("--yes", action="store_true", help="(delete) no second thoughts")
        one.add_argument("--limit", type=int, default=50, help="(history) how many messages")
    result = sub.add_parser("result", help="a finished turn's result, by its id")
    result.add_argument("turn_id", help="the turn's id")
    result.add_argument("--json", action="store_true", help="JSON instead of the answer's text")

    agents = sub.add_parser("agents", help="check or list an agents file as a worker loads it")
    agents_sub = agents.add_subparsers(dest="agents_command", metavar="COMMAND", required=True)
    check = agents_sub.add_parser("check", help="validate it (exit 2 with every problem listed)")
    check.add_argument("file", type=Path, help="the agents file")
    check.set_defaults(json=False)
    listing = agents_sub.add_parser("list", help="print each agent and workflow")
    listing.add_argument("file", type=Path, help="the agents file")
    listing.add_argument("--json", action="store_true", help="JSON lines instead of text")

    schema = sub.add_parser("schema", help="write the JSON Schema of the public contracts")
    schema.add_argument("--out", default="-", help="directory to write into, or - for stdout")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from worker.errors import CliError

    if args.command in (
        "turn",
        "tail",
        "dlq",
        "cancel",
        "approvals",
        "approve",
        "reject",
        "session",
        "result",
    ):
        # the client libraries' own log lines would duplicate our one-line errors
        logging.basicConfig(level=logging.CRITICAL)
    from contracts.runtime.tls import TlsConfigError

    try:
        return _run(args)
    except CliError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return exc.code
    except TlsConfigError as exc:  # TLS files it cannot use (unreadable, for a plain URL)
        sys.stderr.write(f"error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130


def _run(args: argparse.Namespace) -> int:
    if args.command in ("dlq", "session", "result", "agents"):
        return _resources(args)
    if args.command == "worker":
        from worker.app import main as worker_main

        return worker_main()
    if args.command == "tools":
        # tool services are their own program (worker and tool_services never import each
        # other): this process becomes it, keeping its pid and signals
        os.execv(sys.executable, [sys.executable, "-m", "tool_services", args.name])
    tls = _tls()
    if args.command == "turn":
        from worker.cli.turns import run_turn_command

        return asyncio.run(
            run_turn_command(
                amqp_url=args.amqp_url,
                tls=tls.amqp_tls,
                text=args.text,
                agent=args.agent,
                session=args.session,
                follow=args.follow,
                as_json=args.json,
                timeout=args.timeout,
                max_iterations=args.max_iterations,
                deadline_s=args.deadline,
                stream=args.stream,
            )
        )
    if args.command == "cancel":
        from worker.cli.turns import run_cancel_command

        return asyncio.run(
            run_cancel_command(
                amqp_url=args.amqp_url,
                tls=tls.amqp_tls,
                turn_id=args.turn_id,
                reason=args.reason,
                session=args.session,
                by=args.by,
            )
        )
    if args.command == "approvals":
        from worker.cli.approvals import list_approvals

        return asyncio.run(
            list_approvals(
                redis_url=args.redis_url,
                as_json=args.json,
                cluster=args.redis_cluster,
                tls=tls.redis_tls,
            )
        )
    if args.command in ("approve", "reject"):
        from worker.cli.approvals import decide

        return asyncio.run(
            decide(
                amqp_url=args.amqp_url,
                tls=tls.amqp_tls,
                turn_id=args.turn_id,
                call_id=args.call_id,
                verdict=args.command,
                arguments=getattr(args, "arguments", None),
                message=args.message,
                by=args.by,
            )
        )
    if args.command == "tail":
        from worker.cli.turns import run_tail_command

        return asyncio.run(
            run_tail_command(
                amqp_url=args.amqp_url,
                tls=tls.amqp_tls,
                pattern=args.pattern,
                as_json=args.json,
                count=args.count,
                tree=args.tree,
            )
        )
    if args.command == "demo":
        from worker.cli.demo import DEFAULT_QUESTION, WORKFLOW_QUESTION, run_demo

        default = WORKFLOW_QUESTION if args.workflow else DEFAULT_QUESTION
        return asyncio.run(run_demo(args.question or default, workflow=args.workflow))
    if args.command == "schema":
        from contracts.schema import write_schemas

        return write_schemas(args.out)
    raise AssertionError(args.command)


def _dlq(args: argparse.Namespace) -> int:
    from worker.cli.dlq import list_dead, replay
    from worker.errors import CliError

    tls = _tls()
    try:
        if args.dlq_command == "list":
            dead = asyncio.run(list_dead(args.amqp_url, tls.amqp_tls))
            if not dead:
                print("the dead-letter queue is empty")
            for d in dead:
                print(
                    f"{d.id}  {d.code:<14} turn={d.turn_id or '-'}  {d.kind}  {d.size} B  {d.reason}"
                )
            return 0
        found = asyncio.run(replay(args.amqp_url, args.id, tls.amqp_tls))
    except OSError as exc:
        raise CliError(f"cannot reach RabbitMQ: {exc}") from None
    if found is None:
        raise CliError(f"no dead-lettered message with id {args.id!r} (see 'loopwire dlq list')")
    print(f"replayed {found.id} (turn {found.turn_id or '-'}) to the turn queue")
    return 0


def _tls() -> TlsSettings:
    """``LOOPWIRE_AMQP_TLS__*`` and ``LOOPWIRE_REDIS_TLS__*``, as every process reads them."""
    from pydantic import ValidationError

    from contracts.runtime.tls import TlsSettings
    from worker.errors import CliError

    try:
        return TlsSettings()
    except ValidationError as exc:
        raise CliError(f"TLS settings: {exc}", 2) from None


def _resources(args: argparse.Namespace) -> int:
    """Dead letters, sessions, results, agents files."""
    if args.command == "dlq":
        return _dlq(args)
    if args.command == "agents":
        from worker.cli.agents import run_agents_command

        return run_agents_command(args.agents_command, args.file, as_json=args.json)
    from worker.cli.sessions import run_result_command, run_session_command

    tls = _tls()
    if args.command == "result":
        return asyncio.run(
            run_result_command(
                amqp_url=args.amqp_url, tls=tls.amqp_tls, turn_id=args.turn_id, as_json=args.json
            )
        )
    return asyncio.run(
        run_session_command(
            amqp_url=args.amqp_url,
            tls=tls.amqp_tls,
            command=args.session_command,
            session_id=args.session_id,
            as_json=args.json,
            yes=args.yes,
            limit=args.limit,
        )
    )
