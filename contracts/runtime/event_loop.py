"""The event loop a loopwire process runs on (``LOOPWIRE_EVENT_LOOP``): uvloop unless the
standard asyncio loop is asked for. The worker and the HTTP gateway start theirs here; a
server library's own loop option (uvicorn's ``loop``) has no effect on a loop already running."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

EventLoop = Literal["uvloop", "asyncio"]
T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], loop: EventLoop) -> T:
    """``main`` run to its end on a new loop of the kind ``loop`` names."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
