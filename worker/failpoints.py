"""Failpoints for crash testing: ``LOOPWIRE_FAILPOINTS=name[,name…]`` makes the process die
(``os._exit(137)``, as if SIGKILLed) the first time it reaches a named point.

Points: ``model_saved`` (the model's answer was saved, no tool dispatched yet),
``tool_dispatched`` (a tool call was published), ``tool_result_saved`` (a tool
result was saved), ``before_ack`` (everything of a step was saved and published,
the work message not acked yet). Unset in production: then ``hit`` is a no-op.
"""

from __future__ import annotations

import os
import sys

_ARMED = frozenset(filter(None, os.environ.get("LOOPWIRE_FAILPOINTS", "").split(",")))


def hit(point: str) -> None:
    if point in _ARMED:
        sys.stderr.write(f"failpoint {point}: exiting\n")
        sys.stderr.flush()
        os._exit(137)
