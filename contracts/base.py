"""Base pieces shared by every contract: frozen models, safe identifiers, JSON values.

Every document that crosses a process boundary (on the wire or at rest) is a
frozen pydantic model that forbids unknown fields and carries a
``schema_version``. Identifiers that end up in routing keys, Redis keys or AMQP
headers are restricted to a small charset and length so that no publisher can
smuggle a ``.``, ``*``, ``#``, ``{`` or a newline into them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, Self

from pydantic import BaseModel, ConfigDict, StringConstraints

SAFE_ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$"
"""Turn, session and agent ids: letters, digits, ``_`` and ``-``; 1 to 128 characters."""

TOOL_NAME_PATTERN: Final = r"^[A-Za-z0-9_-]{1,64}$"
"""Tool names follow the OpenAI function-name rule, which is also safe in routing keys."""

SafeId = Annotated[str, StringConstraints(pattern=SAFE_ID_PATTERN)]
AgentName = Annotated[str, StringConstraints(pattern=SAFE_ID_PATTERN)]
ToolName = Annotated[str, StringConstraints(pattern=TOOL_NAME_PATTERN)]
CallId = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]
"""A tool call id as a model produced it: printable ASCII without spaces, at most 256 chars."""

JsonObject = dict[str, Any]
"""A JSON object (metadata, tool arguments, tool values). Depth is bounded by the codec."""


_NOT_TRACKED: Final[set[str]] = set()
"""The fields-set of every contract instance: shared, never filled (see ``Contract``)."""


class Contract(BaseModel):
    """Root of every contract: immutable, strict about unknown fields.

    A contract does not remember which of its fields were given explicitly
    (``model_fields_set`` is empty; ``exclude_unset`` does not apply): pydantic keeps a set of
    their names in every instance, up to 0.7 KB each, and a worker holds about ten contract
    instances per turn while the model thinks. The set is shared and never written: contracts
    are frozen, and a copy (``model_copy``) shares it too. A contract that needs it (``worker.agents.AgentProfile``) overrides ``model_post_init``."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", populate_by_name=True, allow_inf_nan=False
    )

    def model_post_init(self, context: Any, /) -> None:
        object.__setattr__(self, "__pydantic_fields_set__", _NOT_TRACKED)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """pydantic's shallow copy — the updated values are not validated — without its general
        case (``copy.copy`` of four attributes) and sharing the fields-set as construction does:
        a step copies a dozen contracts. A deep copy, or a contract that keeps its fields-set,
        goes through pydantic."""
        if deep or self.__pydantic_fields_set__ is not _NOT_TRACKED:
            return super().model_copy(update=update, deep=deep)
        values = self.__dict__.copy()
        if update:
            values.update(update)
        copied = object.__new__(type(self))
        object.__setattr__(copied, "__dict__", values)
        object.__setattr__(copied, "__pydantic_extra__", None)
        object.__setattr__(copied, "__pydantic_fields_set__", _NOT_TRACKED)
        object.__setattr__(copied, "__pydantic_private__", None)
        return copied

    def __eq__(self, other: object) -> bool:
        """pydantic's comparison — the same class and the same field values — without its
        general case: contracts have no private attributes, extras or generic parameters.
        Writing a state at rest compares every sub-model with its default (``exclude_defaults``),
        usually the shared default instance itself."""
        if self is other:
            return True
        if type(other) is type(self):
            return self.__dict__ == other.__dict__
        return super().__eq__(other)


def utf8_len_ok(value: str, limit: int) -> bool:
    """True when ``value`` encodes to at most ``limit`` bytes of UTF-8."""
    return len(value) <= limit and len(value.encode("utf-8", "surrogatepass")) <= limit
