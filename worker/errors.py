"""One exception root, split by who handles the failure.

- ``RetryableError``: the work is requeued and redone (Redis down, lost connection).
- ``PermanentError``: the work can never succeed; it is dead-lettered with ``code`` and a reason.
- ``ToolCallError``: a tool call failed; the message goes back to the model as ``{"error": ...}``.
- ``ModelError``: the model could not answer; the turn fails with ``code``.
- ``ConfigError``: a setting that cannot be used; a process stops at start, naming the variable.
- ``CliError``: the ``loopwire`` command stops with one line and an exit code.
- ``FailpointError``: an armed ``raise-<name>`` failpoint (tests of crash handling).
"""

from __future__ import annotations


class LoopwireError(Exception):
    """Root of every error loopwire raises on purpose."""


class RetryableError(LoopwireError):
    """Transient: requeue the work and try again later."""


class StaleStateError(RetryableError):
    """A compare-and-set lost: another worker wrote the state or holds the session lease."""


class PermanentError(LoopwireError):
    """The work can never succeed: dead-letter it with a reason."""

    def __init__(self, message: str, *, code: str = "invalid") -> None:
        super().__init__(message)
        self.code = code


class ToolCallError(LoopwireError):
    """A tool call failed; its message is returned to the model."""


class ToolUnavailableError(ToolCallError):
    """No tool service can take the call (none bound, or the broker refused it)."""


class ModelError(LoopwireError):
    """The model call failed for good (after the client's own retries)."""

    def __init__(
        self, message: str, *, code: str = "model_error", retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after
        """Set when the endpoint said to slow down (429): the seconds it asked to wait."""


class ProfileError(LoopwireError, ValueError):
    """An agents file that cannot be loaded: the message names the profile and the part."""


class ConfigError(LoopwireError, ValueError):
    """Settings that cannot be used: the one-line message names the variable, never its value."""


class CliError(LoopwireError):
    """An error the ``loopwire`` command shows as one line, with an exit code (1 unless said)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class NotReplayableError(CliError):
    """A dead letter that replaying would not run again; it stays where it is (exit code 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=2)


class FailpointError(LoopwireError):
    """Raised at an armed ``raise-<name>`` failpoint: stands for any unexpected error."""
