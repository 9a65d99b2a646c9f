"""The ``loopwire`` command: worker, tool services, turns, the dead-letter queue, the demo."""

from worker.cli.main import main

__all__ = ["main"]
