"""Settings read from files: ``LOOPWIRE_<NAME>_FILE`` holds the value of ``LOOPWIRE_<NAME>``.

Docker and Kubernetes hand secrets to a container as files; every setting of the workers and
the tool services may come from one, nested settings too (``LOOPWIRE_AMQP_URL_FILE``,
``LOOPWIRE_REDIS_URL_FILE``, ``LOOPWIRE_MODEL__API_KEY_FILE``). The file's content is the
value, less a trailing newline. A setting given both ways is refused (which one was meant is
not clear), as is a file that cannot be read; the error names the variable and the file,
never what it holds. A variable that is itself the name of a setting is that setting, not a
file holding another: ``LOOPWIRE_AMQP_TLS__CA_FILE`` is the path of a CA file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

SUFFIX = "_FILE"


class SecretFiles(PydanticBaseSettingsSource):
    """A settings source: the ``<prefix><NAME>_FILE`` variables, each read from its file."""

    def __init__(
        self, settings_cls: type[BaseSettings], environ: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(settings_cls)
        self.environ = os.environ if environ is None else environ
        self.prefix = str(settings_cls.model_config.get("env_prefix") or "").upper()
        self.delimiter = str(settings_cls.model_config.get("env_nested_delimiter") or "__")

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # everything is read at once (__call__)

    def __call__(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        fields = self.settings_cls.model_fields
        delim = self.delimiter.lower()
        for variable, path in self.environ.items():
            name = variable.upper()
            if not (name.startswith(self.prefix) and name.endswith(SUFFIX)):
                continue
            setting = name[: -len(SUFFIX)]
            parts = setting[len(self.prefix) :].lower().split(self.delimiter.lower())
            if parts[0] not in fields:
                continue  # not a setting of this process (e.g. a provider's own key file)
            if _names_field(self.settings_cls, name[len(self.prefix) :].lower().split(delim)):
                continue  # a setting whose own name ends in _FILE (LOOPWIRE_AMQP_TLS__CA_FILE)
            if any(key.upper() == setting for key in self.environ):
                raise ValueError(f"give {setting} or {name}, not both")
            node = found
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = _read(name, path)
        return found


def _names_field(model: type[BaseModel], parts: list[str]) -> bool:
    """Whether ``parts`` (a variable's name less the prefix, split at the delimiter) is the
    path of a field of ``model`` through its nested models."""
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        if i == len(parts) - 1:
            return True
        annotation = field.annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return False
        model = annotation
    return False


def _read(variable: str, path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{variable}: cannot read {path}: {exc.strerror}") from None
    return text.rstrip("\r\n")


def with_secret_files(
    settings_cls: type[BaseSettings],
    init_settings: PydanticBaseSettingsSource,
    env_settings: PydanticBaseSettingsSource,
    dotenv_settings: PydanticBaseSettingsSource,
    file_secret_settings: PydanticBaseSettingsSource,
) -> tuple[PydanticBaseSettingsSource, ...]:
    """The sources of a settings class that reads ``_FILE`` variables: what
    ``settings_customise_sources`` returns."""
    return (
        init_settings,
        env_settings,
        SecretFiles(settings_cls),
        dotenv_settings,
        file_secret_settings,
    )


class LoopwireSettings(BaseSettings):
    """The settings of a loopwire process: ``LOOPWIRE_`` variables, nested with ``__``, each
    readable from a file (``LOOPWIRE_<NAME>_FILE``)."""

    model_config = SettingsConfigDict(
        env_prefix="LOOPWIRE_", env_nested_delimiter="__", extra="ignore"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return with_secret_files(
            settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
        )
