"""``python -m tool_services NAME``: run the tool service NAME (an example's name or a module
path), as ``loopwire tools serve NAME`` does."""

import sys

from tool_services.runner import serve

if len(sys.argv) != 2:
    sys.stderr.write("usage: python -m tool_services NAME\n")
    sys.exit(2)
sys.exit(serve(sys.argv[1]))
