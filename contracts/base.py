"""Base pieces shared by every contract: frozen models, safe identifiers, JSON values.

Every document that crosses a process boundary (on the wire or at rest) is a
frozen pydantic model that forbids unknown fields and carries a
``schema_version``. Identifiers that end up in routing keys, Redis keys or AMQP
headers are restricted to a small charset and length so that no publisher can
smuggle a ``.``, ``*``, ``#``, ``{`` or a newline into them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, NoReturn, Self

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


class _NotTracked(set[str]):
    """An empty set that refuses every write: the fields-set all contracts share.

    pydantic writes to a model's fields-set when it assigns a field or copies with an update;
    on this set a write raises, so such a path fails instead of giving every contract the
    written names. pydantic-core's own writes (``validate_assignment``) add through the C API,
    past these methods: the next contract construction then fails (``Contract.model_post_init``).
    A copy (``copy``, ``deepcopy``, pickle) is this very set. It has to be a ``set``: pydantic's
    serializer refuses anything else (a ``frozenset``) for ``exclude_unset``."""

    __slots__ = ()

    def __init__(self) -> None:  # ``set.__init__`` would refill the set
        super().__init__()

    def _refuse(self, *args: object) -> NoReturn:
        raise TypeError("contracts keep no fields-set: their shared empty set is read-only")

    add = discard = remove = pop = clear = update = _refuse
    intersection_update = difference_update = symmetric_difference_update = _refuse
    __ior__ = __iand__ = __isub__ = __ixor__ = _refuse

    def __reduce__(self) -> str:
        return "_NOT_TRACKED"


_NOT_TRACKED: Final = _NotTracked()
"""The fields-set of every contract instance: shared and empty (see ``Contract``)."""


class Contract(BaseModel):
    """Root of every contract: immutable, strict about unknown fields.

    A contract does not remember which of its fields were given explicitly
    (``model_fields_set`` is empty; ``exclude_unset`` leaves out every field): pydantic would
    keep a set of their names in every instance, and a worker holds many contract instances per
    turn while the model thinks. All contracts share one read-only empty set instead, copies
    included (``model_copy``). A contract that needs its fields-set
    (``worker.profiles.agents.AgentProfile``) overrides ``model_post_init``."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", populate_by_name=True, allow_inf_nan=False
    )

    def model_post_init(self, context: Any, /) -> None:
        if _NOT_TRACKED:  # written through the C API (see ``_NotTracked``)
            raise RuntimeError(f"the contracts' shared fields-set was written: {_NOT_TRACKED}")
        object.__setattr__(self, "__pydantic_fields_set__", _NOT_TRACKED)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """pydantic's copy — the updated values are neither validated nor copied — except that
        the copy shares the fields-set as construction does instead of adding the updated names
        to it. A shallow copy skips pydantic's general case (``copy.copy`` of four attributes):
        a step copies many contracts. A contract that keeps its fields-set goes through
        pydantic."""
        if self.__pydantic_fields_set__ is not _NOT_TRACKED:
            return super().model_copy(update=update, deep=deep)
        if deep:
            copied = self.__deepcopy__()
            if update:
                copied.__dict__.update(update)
            return copied
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
        general case: contracts have no private attributes, extras, generic parameters or
        cached properties. Writing a state at rest compares every sub-model with its default
        (``exclude_defaults``), usually the shared default instance itself."""
        if self is other:
            return True
        if type(other) is type(self):
            return self.__dict__ == other.__dict__
        return super().__eq__(other)


def utf8_len_ok(value: str, limit: int) -> bool:
    """True when ``value`` encodes to at most ``limit`` bytes of UTF-8."""
    return len(value) <= limit and len(value.encode("utf-8", "surrogatepass")) <= limit
