"""``loopwire tools mcp-check FILE [--connect]``: check an MCP bridge configuration file as the
bridge would load it (docs/mcp.md). ``loopwire tools serve mcp`` runs the bridge itself.

The bridge is a tool service, its own program: like ``tools serve``, this process becomes
``python -m tool_services.mcp check ...`` (the worker never imports the tool services).
Exit 0, or 2 with every problem listed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def add_parser(tools_sub: Any) -> None:
    check = tools_sub.add_parser(
        "mcp-check", help="check an MCP bridge configuration file (exit 2 with the problems)"
    )
    check.add_argument("file", type=Path, help="the bridge's configuration file (JSON)")
    check.add_argument(
        "--connect", action="store_true", help="also start each server and list its tools"
    )


def run(args: argparse.Namespace) -> int:
    argv = [sys.executable, "-m", "tool_services.mcp", "check", str(args.file)]
    os.execv(sys.executable, argv + (["--connect"] if args.connect else []))
