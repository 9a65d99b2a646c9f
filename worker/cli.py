"""The ``loopwire`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loopwire", description="Queue-native runtime for LLM agent loops."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("worker", help="run a worker (configured by LOOPWIRE_* variables)")
    tools = sub.add_parser("tools", help="tool services")
    tools_sub = tools.add_subparsers(dest="tools_command", metavar="COMMAND", required=True)
    serve = tools_sub.add_parser("serve", help="run the tool service NAME (tool_services.NAME)")
    serve.add_argument("name", help="search, calculator, notes, …")
    schema = sub.add_parser("schema", help="write the JSON Schema of the public contracts")
    schema.add_argument("--out", default="-", help="directory to write into, or - for stdout")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "worker":
        from worker.app import main as worker_main

        return worker_main()
    if args.command == "tools":
        from tool_services.runner import serve

        return serve(args.name)
    if args.command == "schema":
        from contracts.schema import write_schemas

        return write_schemas(args.out)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
