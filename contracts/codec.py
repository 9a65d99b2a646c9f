"""msgpack codec with hard limits, for every contract on the wire and at rest, and the JSON
that the session state is written as (``encode_stored``).

Decoding never trusts a length header: msgpack's own limits reject a container
claiming more items, or a string claiming more bytes, than the message could
hold, before anything is allocated; nesting is bounded by msgpack's fixed parser
stack and then by ``MAX_DEPTH``; map keys must be strings; strings must be valid
UTF-8; trailing bytes are an error. Every failure is one ``DecodeError`` with a
readable reason, never a crash.
"""

from __future__ import annotations

import json
from typing import Any, Final, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024
MAX_DEPTH: Final = 32
MAX_CONTAINER_ITEMS: Final = 100_000

M = TypeVar("M", bound=BaseModel)


class DecodeError(ValueError):
    """Bytes that are not a valid message of the expected contract."""

    def __init__(self, reason: str, *, code: str = "malformed") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


def encode(model: BaseModel) -> bytes:
    """Encode a contract as msgpack (JSON-compatible data, no pickle, no ext types).

    Every field is written, except fields added to a message after its first version, which
    are written only when set (``exclude_if`` on the field): a peer of an earlier version of
    the same ``schema_version`` reads what this one writes, unless the new feature is used."""
    data = model.model_dump(mode="json", exclude_defaults=False)
    return encode_obj(data)


def encode_stored(model: BaseModel, *, exclude: set[str] | None = None) -> bytes:
    """Encode a contract loopwire keeps for itself (state at rest) as JSON, without the fields
    that hold their default. pydantic-core writes it and reads it back (``read_stored``)
    without a pass through Python objects, cheaper both ways than msgpack (reading the more
    so), and a default sub-model comes back as the one shared instance, not a new object per
    read. (On the wire every field is written, as msgpack: ``encode``.) A changed default is a
    schema change: ``schema_version`` is always written, so a later version can tell what it
    reads."""
    data: bytes = model.__pydantic_serializer__.to_json(
        model, exclude=exclude, exclude_defaults=True
    )
    version = getattr(model, "schema_version", None)
    if isinstance(version, int) and not data.startswith(b'{"schema_version"'):
        rest = data[1:] if data == b"{}" else b"," + data[1:]
        data = b'{"schema_version":%d' % version + rest
    return data


def read_stored(data: bytes, model: type[M]) -> M:
    """What ``encode_stored`` wrote (JSON), or msgpack written by an earlier version."""
    if data[:1] == b"{":
        try:
            return model.model_validate_json(data)
        except ValidationError as exc:
            raise DecodeError(f"invalid {model.__name__}: {_errors(exc)}", code="schema") from None
    return validate(decode_stored(data), model)


def encode_obj(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True, datetime=False)
    return packed


def decode_obj(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Decode msgpack bytes into plain Python data under the codec's limits."""
    size = len(data)
    if size > max_bytes:
        raise DecodeError(f"message is {size} bytes; the limit is {max_bytes}", code="oversize")
    if size == 0:
        raise DecodeError("message is empty")
    limit = min(size, MAX_CONTAINER_ITEMS)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=0,
            ext_hook=_reject_ext,
        )
    except msgpack.ExtraData:
        if _is_json(data):
            raise DecodeError(NOT_MSGPACK_JSON) from None
        raise DecodeError("trailing bytes after the message") from None
    except msgpack.StackError:
        raise DecodeError("message nests too deeply") from None
    except UnicodeDecodeError as exc:
        raise DecodeError(f"invalid UTF-8 in a string: {exc.reason}") from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        if _is_json(data):
            raise DecodeError(NOT_MSGPACK_JSON) from None
        raise DecodeError(f"not valid msgpack: {_short(str(exc)) or type(exc).__name__}") from None
    _check_structure(obj)
    return obj


NOT_MSGPACK_JSON: Final = (
    "not msgpack: the body is JSON; encode it as msgpack (content type application/msgpack)"
)


def _is_json(data: bytes) -> bool:
    """Whether a body that msgpack refused is a JSON text (a publisher's usual mistake)."""
    if data.lstrip()[:1] not in (b"{", b"[", b'"'):
        return False
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def decode(data: bytes, model: type[M], *, max_bytes: int = MAX_MESSAGE_BYTES) -> M:
    """Decode msgpack bytes into ``model``; any problem is a ``DecodeError``."""
    obj = decode_obj(data, max_bytes=max_bytes)
    return validate(obj, model)


def decode_stored(data: bytes) -> Any:
    """Decode msgpack that loopwire wrote itself (a state written as msgpack), without the walk
    over every container that guards messages from outside: what ``encode`` wrote is
    JSON-compatible."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_reject_ext)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise DecodeError(f"stored data is not valid msgpack: {_short(str(exc))}") from None


def validate(obj: Any, model: type[M]) -> M:
    if not isinstance(obj, dict):
        raise DecodeError(
            f"expected a map for {model.__name__}, got {type(obj).__name__}", code="schema"
        )
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise DecodeError(f"invalid {model.__name__}: {_errors(exc)}", code="schema") from None


def _check_structure(obj: Any) -> None:
    """Reject data nested deeper than ``MAX_DEPTH``, binary data and non-string map keys.

    Iterative, so there is no recursion to exhaust. msgpack's ``strict_map_key``
    still admits ``bin`` keys, and ``bin`` values would pass pydantic's lax
    ``str``/``Any`` fields and then make ``encode`` (JSON mode) fail, so both are
    rejected here: a decoded message is always JSON-compatible.
    """
    if isinstance(obj, bytes):
        raise _binary()
    if not isinstance(obj, dict | list):
        return
    stack: list[tuple[Any, int]] = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if depth >= MAX_DEPTH:
            raise DecodeError(f"message nests deeper than {MAX_DEPTH} levels")
        children: Any = node
        if isinstance(node, dict):
            if not all(isinstance(key, str) for key in node):
                raise DecodeError("map keys must be strings (msgpack str, not bin)")
            children = node.values()
        for child in children:
            if isinstance(child, bytes):
                raise _binary()
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))


def _reject_ext(code: int, data: bytes) -> Any:
    """``max_ext_len=0`` still lets an empty ext through; no ext type is allowed at all."""
    raise ValueError(f"ext types are not allowed (got ext type {code})")


def _binary() -> DecodeError:
    return DecodeError("binary data (msgpack bin) is not allowed; use a string")


def _errors(exc: ValidationError) -> str:
    parts = []
    errors = exc.errors(include_url=False, include_input=False)
    # an item that failed also leaves its list short ("should have at least 1 item"): only the
    # item's own error says what is wrong
    errors = [
        e
        for e in errors
        if not any(
            len(o["loc"]) > len(e["loc"]) and o["loc"][: len(e["loc"])] == e["loc"] for o in errors
        )
    ]
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    more = len(errors) - len(parts)
    if more > 0:
        parts.append(f"and {more} more")
    return _short("; ".join(parts), 1000)


def _short(text: str, limit: int = 300) -> str:
    text = text.replace("\n", " ").replace("\r", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"
