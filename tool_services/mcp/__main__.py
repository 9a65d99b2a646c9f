"""``python -m tool_services.mcp``: serve the bridge; ``... check FILE [--connect]``: check a
configuration file; ``... schema``: write its JSON Schema (``config.schema.json``)."""

import sys
from pathlib import Path

from tool_services.runner import serve

args = sys.argv[1:]
if args[:1] == ["check"] and len(args) in (2, 3) and args[2:] in ([], ["--connect"]):
    from tool_services.mcp.check import run_check

    sys.exit(run_check(Path(args[1]), connect=args[2:] == ["--connect"]))
if args == ["schema"]:
    from tool_services.mcp.config import write_schema

    write_schema()
    sys.exit(0)
if args:
    sys.stderr.write("usage: python -m tool_services.mcp [check FILE [--connect] | schema]\n")
    sys.exit(2)
sys.exit(serve("mcp"))
