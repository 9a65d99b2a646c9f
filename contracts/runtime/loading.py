"""Loading a process's settings, and saying in one line which variable is wrong.

``load(Settings)`` is how the worker, the tool services and the ``loopwire`` command build
their settings: what pydantic-settings refuses becomes one ``SettingsError`` whose message
names the environment variable (``LOOPWIRE_PREFETCH``, ``LOOPWIRE_MODEL__TIMEOUT_S``), or its
file form when that is the one given (``LOOPWIRE_AMQP_URL_FILE``), and what is wrong with it,
never the value (it may be a secret). A setting that cannot be used is refused, never
replaced by its default.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings
from pydantic_settings import SettingsError as SourceError

from contracts.runtime.secrets import SUFFIX

S = TypeVar("S", bound=BaseSettings)


class SettingsError(ValueError):
    """Settings that cannot be used; the message names the variable (one line)."""


def load(cls: type[S], environ: Mapping[str, str] | None = None) -> S:
    """``cls()`` from the environment, or ``SettingsError`` naming what is wrong."""
    environ = os.environ if environ is None else environ
    try:
        return cls()
    except ValidationError as exc:
        raise SettingsError(describe(exc, cls, environ)) from None
    except SourceError as exc:  # a complex value (JSON) that does not parse
        found = re.search(r'field "([^"]+)"', str(exc))
        name = variable(cls, [found.group(1)] if found else [], environ)
        raise SettingsError(f"{name}: not valid JSON") from None
    except ValueError as exc:  # a file that cannot be read, a setting given both ways
        raise SettingsError(str(exc).replace("\n", " ")) from None


def describe(exc: ValidationError, cls: type[BaseModel], environ: Mapping[str, str]) -> str:
    """Every problem of ``exc``, each as ``VARIABLE: what is wrong``, on one line."""
    parts = []
    for error in exc.errors(include_url=False, include_input=False):
        name = variable(cls, [str(p) for p in error["loc"]], environ)
        parts.append(f"{name}: {sentence(error['msg'])}")
    return "; ".join(dict.fromkeys(parts))


def sentence(message: str) -> str:
    """pydantic's message as the rest of a sentence (``Value error, `` and the capital
    dropped)."""
    message = message.removeprefix("Value error, ")
    return message[:1].lower() + message[1:]


def variable(cls: type[BaseModel], loc: Sequence[str], environ: Mapping[str, str]) -> str:
    """The environment variable that sets the field at ``loc``: nested models joined with the
    delimiter, anything deeper (a JSON value) is its field's variable; its ``_FILE`` form when
    that is the one set."""
    config = getattr(cls, "model_config", {})
    prefix = str(config.get("env_prefix") or "").upper()
    delimiter = str(config.get("env_nested_delimiter") or "__")
    names: list[str] = []
    model: type[BaseModel] | None = cls
    for part in loc:
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            break
        names.append(part.upper())
        annotation = field.annotation
        model = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )
        if model is None:
            break
    name = prefix + delimiter.join(names) if names else prefix.rstrip("_") + " settings"
    if name not in environ and name + SUFFIX in environ:
        return name + SUFFIX
    return name
