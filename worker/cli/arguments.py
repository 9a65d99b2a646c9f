"""Arguments checked before anything is sent: a value the contracts refuse is one line that
names the option (``--session 'bad id!': ...``), exit 2, never a validation dump."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from contracts.base import SAFE_ID_PATTERN, SafeId
from contracts.runtime.loading import sentence
from worker.cli import exits
from worker.errors import CliError

T = TypeVar("T")

SAFE_ID_RULE = (
    "must start with a letter or digit and hold only letters, digits, '-' and '_' (at most 128)"
)
_SAFE_ID: TypeAdapter[str] = TypeAdapter(SafeId)


def problem(exc: ValidationError) -> str:
    """The first problem of ``exc`` as the rest of a sentence."""
    error = exc.errors(include_url=False)[0]
    if error["type"] == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") == (
        SAFE_ID_PATTERN
    ):
        return SAFE_ID_RULE
    return sentence(error["msg"])


def bad(option: str, exc: ValidationError, value: Any = None) -> CliError:
    """The ``CliError`` of ``option`` (shown with ``value`` when given)."""
    shown = f" {value!r}" if value is not None else ""
    return CliError(f"{option}{shown}: {problem(exc)}", exits.USAGE)


def safe_id(value: str, option: str) -> str:
    """``value`` if it is a valid id (a session's, a turn's), else a ``CliError``."""
    try:
        return _SAFE_ID.validate_python(value)
    except ValidationError as exc:
        raise bad(option, exc, value) from None


def valid(adapter: TypeAdapter[T], value: object, option: str, *, show: bool = True) -> T:
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise bad(option, exc, value if show else None) from None


def bad_field(exc: ValidationError, options: dict[str, str], default: str) -> CliError:
    """The ``CliError`` of the first field ``exc`` refuses, named by its option."""
    loc = exc.errors(include_url=False)[0]["loc"]
    return bad(options.get(str(loc[0]) if loc else "", default), exc)
