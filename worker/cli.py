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
    schema = sub.add_parser("schema", help="write the JSON Schema of the public contracts")
    schema.add_argument("--out", default="-", help="directory to write into, or - for stdout")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "schema":
        from contracts.schema import write_schemas

        return write_schemas(args.out)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
