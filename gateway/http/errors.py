"""The one error of the gateway's routes: a request it refuses, with its HTTP status."""

from __future__ import annotations


class RunError(Exception):
    """A request the gateway refuses: its HTTP status and why (answered as JSON)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
