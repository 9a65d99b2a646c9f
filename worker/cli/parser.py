"""The ``loopwire`` command line's arguments (``worker.cli.main`` runs them).

The connection options (``--amqp-url``, ``--redis-url``, ``--redis-cluster``) and
``--tenant`` are accepted before or after the command (``worker.cli.connection``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from worker.cli import mcp_bridge
from worker.cli.connection import add_options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loopwire", description="Queue-native runtime for LLM agent loops."
    )
    add_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add(sub, "worker", help="run a worker (configured by LOOPWIRE_* variables)")
    tools = _add(sub, "tools", help="tool services")
    tools_sub = tools.add_subparsers(dest="tools_command", metavar="COMMAND", required=True)
    serve = _add(tools_sub, "serve", help="run the tool service NAME (tool_services.NAME)")
    serve.add_argument("name", help="search, calculator, notes, mcp, or a module path")
    mcp_bridge.add_parser(tools_sub)

    turn = _add(sub, "turn", help="send a turn and print the answer")
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

    cancel = _add(sub, "cancel", help="cancel a turn wherever it is (turn.cancel)")
    cancel.add_argument("turn_id", help="the turn's id")
    cancel.add_argument("--reason", default="cancelled", help="why (the result's stopped_by)")
    cancel.add_argument("--session", default=None, help="its session id (saves a lookup)")
    cancel.add_argument("--by", default=None, help="who asks (for the log)")
    cancel.add_argument(
        "--rollback",
        action="store_true",
        help="also remove the turn's messages from its session's history",
    )

    approvals = _add(sub, "approvals", help="list the tool calls waiting for a decision")
    approvals.add_argument("--json", action="store_true", help="JSON lines instead of text")
    for verb, what in (("approve", "approve (or, with --arguments, edit)"), ("reject", "reject")):
        decide = _add(sub, verb, help=f"{what} a tool call a turn waits on")
        decide.add_argument("turn_id", help="the turn's id")
        decide.add_argument("call_id", help="the call's id (from 'loopwire approvals')")
        decide.add_argument("--by", default=None, help="who decides")
        decide.add_argument("--message", default=None, help="for the model (with a rejection)")
        if verb == "approve":
            decide.add_argument(
                "--arguments", default=None, help="run the call with these (a JSON object)"
            )

    tail = _add(sub, "tail", help="print events matching a routing-key pattern")
    tail.add_argument("pattern", nargs="?", default="#", help="e.g. 'tool.invoked.#' (default: #)")
    tail.add_argument("--json", action="store_true", help="JSON lines instead of text")
    tail.add_argument("--count", type=int, default=None, help="exit after this many events")
    tail.add_argument(
        "--tree", metavar="TURN_ID", default=None, help="a turn's events and its child turns'"
    )

    dlq = _add(sub, "dlq", help="dead-lettered work")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", metavar="COMMAND", required=True)
    dead = _add(dlq_sub, "list", help="list dead-lettered messages with their reasons")
    dead.add_argument("--json", action="store_true", help="JSON lines instead of text")
    replay = _add(dlq_sub, "replay", help="send a dead-lettered message back to the turn queue")
    replay.add_argument("id", help="the id shown by 'loopwire dlq list'")
    purge = _add(dlq_sub, "purge", help="remove a dead-lettered message for good")
    purge.add_argument("id", nargs="?", default=None, help="the id shown by 'loopwire dlq list'")
    purge.add_argument(
        "--all", action="store_true", help="every letter shown by 'loopwire dlq list'"
    )

    demo = _add(sub, "demo", help="run one real turn through a worker and the example tools")
    demo.add_argument("question", nargs="?", default=None, help="what to ask")
    demo.add_argument(
        "--workflow",
        action="store_true",
        help="run the triage workflow: a classifier routes to agents, one of which asks another",
    )
    demo.add_argument(
        "--http",
        action="store_true",
        help="run the turn through the HTTP gateway, with curl and the langgraph-sdk client",
    )

    session = _add(sub, "session", help="a session: its summary, history, deletion")
    session_sub = session.add_subparsers(dest="session_command", metavar="COMMAND", required=True)
    for verb, what in (
        ("show", "its summary and turns"),
        ("history", "its newest messages"),
        ("delete", "delete it (its turns cancelled first)"),
    ):
        one = _add(session_sub, verb, help=what)
        one.add_argument("session_id", help="the session's id")
        one.add_argument("--json", action="store_true", help="JSON instead of text")
        one.add_argument("--yes", action="store_true", help="(delete) no second thoughts")
        one.add_argument("--limit", type=int, default=50, help="(history) how many messages")
    result = _add(sub, "result", help="a finished turn's result, by its id")
    result.add_argument("turn_id", help="the turn's id")
    result.add_argument("--json", action="store_true", help="JSON instead of the answer's text")

    agents = _add(sub, "agents", help="check or list an agents file as a worker loads it")
    agents_sub = agents.add_subparsers(dest="agents_command", metavar="COMMAND", required=True)
    check = _add(agents_sub, "check", help="validate it (exit 2 with every problem listed)")
    check.add_argument("file", type=Path, help="the agents file")
    check.set_defaults(json=False)
    listing = _add(agents_sub, "list", help="print each agent and workflow")
    listing.add_argument("file", type=Path, help="the agents file")
    listing.add_argument("--json", action="store_true", help="JSON lines instead of text")

    _mcp_parser(sub)
    _gateway_parser(sub)

    schema = _add(sub, "schema", help="write the JSON Schema of the public contracts")
    schema.add_argument("--out", default="-", help="directory to write into, or - for stdout")
    return parser


def _gateway_parser(sub: Any) -> None:
    gateway = _add(sub, "gateway", help="the HTTP front door (docs/http.md)")
    gateway_sub = gateway.add_subparsers(dest="gateway_command", metavar="COMMAND", required=True)
    serve = _add(gateway_sub, "serve", help="serve threads, runs and streams over HTTP")
    serve.add_argument("--host", help="default: $LOOPWIRE_GATEWAY__HOST or 127.0.0.1")
    serve.add_argument("--port", type=int, help="default: $LOOPWIRE_GATEWAY__PORT or 8123")
    serve.add_argument("--keys-file", type=Path, help="default: $LOOPWIRE_GATEWAY__KEYS_FILE")
    serve.add_argument("--agents-file", type=Path, help="default: $LOOPWIRE_AGENTS_FILE")
    key = _add(gateway_sub, "key", help="make an API key and its line for the keys file")
    key.add_argument("--name", required=True, help="what the key is for (shown in logs)")
    key.add_argument("--for-tenant", dest="key_tenant", help="the tenant the key acts for")


def _mcp_parser(sub: Any) -> None:
    mcp = _add(sub, "mcp", help="loopwire agents as MCP tools")
    mcp_sub = mcp.add_subparsers(dest="mcp_command", metavar="COMMAND", required=True)
    serve = _add(
        mcp_sub,
        "serve",
        help='offer the agents marked "mcp" as MCP tools (stdio or Streamable HTTP)',
    )
    serve.add_argument(
        "--agents-file",
        type=Path,
        default=os.environ.get("LOOPWIRE_AGENTS_FILE") or None,
        help="the agents file (default: $LOOPWIRE_AGENTS_FILE)",
    )
    serve.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    serve.add_argument("--host", default="127.0.0.1", help="(http) default: %(default)s")
    serve.add_argument("--port", type=int, default=8765, help="(http) default: %(default)s")
    serve.add_argument("--path", default="/mcp", help="(http) default: %(default)s")
    serve.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="a call's turn deadline in seconds (default: %(default)s)",
    )
    serve.add_argument(
        "--remind-every",
        type=float,
        default=30.0,
        help="seconds between reminders that a call waits for a decision (default: %(default)s)",
    )
    serve.add_argument(
        "--metrics-port", type=int, default=None, help="serve /metrics, /livez, /readyz there"
    )
    serve.add_argument("--log-level", default="warning", help="on stderr (default: %(default)s)")


def _add(group: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A (sub)command's parser, taking the connection options and ``--tenant`` too."""
    parser: argparse.ArgumentParser = group.add_parser(name, **kwargs)
    add_options(parser)
    return parser
