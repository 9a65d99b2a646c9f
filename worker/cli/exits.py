"""The exit codes of the ``loopwire`` command (docs/operations.md lists them).

Every error is one line on stderr, ``error: <what happened>``, naming the argument or the
setting at fault, and exits with one of these codes.
"""

from __future__ import annotations

from typing import Final

OK: Final = 0
ERROR: Final = 1
"""Anything else: RabbitMQ or Redis unreachable, no answer in time."""
USAGE: Final = 2
"""A bad argument or setting (named), an invalid agents file, a dead letter not replayable."""
TURN_FAILED: Final = 3
"""``turn``: the turn failed, was cancelled or was rejected."""
MAX_ITERATIONS: Final = 4
"""``turn``: the iteration cap ended the turn; the text printed is not an answer."""
NOT_FOUND: Final = 5
"""What the command names does not exist (a session, a turn, a result, a dead letter), or
the turn has finished, so there is nothing to cancel or decide."""
INTERRUPTED: Final = 130
"""Ctrl-C."""
CLOSED_PIPE: Final = 141
"""The reader of the output went away (``| head``): as a command killed by SIGPIPE, quietly."""
