import sys

from tool_services.runner import serve

sys.exit(serve("memory"))
