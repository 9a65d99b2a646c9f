"""Python's cyclic garbage collector, set for a process that runs for weeks at a steady load.

A step allocates many short-lived objects (pydantic models, coroutines, futures, AMQP
frames); with the default threshold (a young-generation collection every 700 net allocations)
the collector runs many times a second under load and walks every object of the turns in
flight each time, promoting them to older generations it then walks again, and a full
collection walks everything startup built (modules, the ``openai`` client, settings), a long
pause each time. With the defaults the collector takes a sizeable share of the worker's CPU;
with ``tune`` very little.

``tune`` moves what startup built out of the collector's reach (``gc.freeze``: it lives as
long as the process) and collects the young generation every ``young`` allocations instead.
Reference counting still frees almost everything at once; only garbage in reference cycles
waits longer (at most ``young`` objects).
"""

from __future__ import annotations

import gc


def tune(young: int) -> None:
    """Freeze what exists now and collect the young generation every ``young`` allocations
    (``0``: Python's defaults, nothing frozen)."""
    if young <= 0:
        return
    gc.collect()  # what startup left as garbage is not frozen with the rest
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old)
