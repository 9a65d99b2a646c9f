"""Run a module as a child of the benchmark, stopped when the benchmark process dies.

``python tests/bench/child.py <parent-pid> <module> [args ...]`` runs ``<module>`` as
``python -m <module> [args ...]`` would (same process: its CPU and memory are read from its
pid), after asking Linux to send it SIGTERM when its parent exits. A benchmark run that is
interrupted, even killed, then leaves no worker, tool service or model server behind to compete
for the CPU of the next run or to consume from the bench vhost's queues. It is run by path, not
with ``-m``, so that it works for a ``--source`` checkout that does not have it.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> bool:
    """SIGTERM to this process when its parent exits; ``False`` where that cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent was gone before we asked
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def main() -> None:
    parent, module, *rest = sys.argv[1:]
    die_with(int(parent))
    sys.path[0] = os.getcwd()  # what ``python -m`` puts first, instead of this file's directory
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
