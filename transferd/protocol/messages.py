"""Body fields shared by both ends: tensors by value, and field validation.

A tensor is ``[buffer, offset, size]`` on the wire; :class:`Tensor` is its
immutable Python form.  Every ``field``/``tensor`` helper raises BadRequest
naming the field, so a malformed request is answered, never crashed on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from .errors import BadRequest

U64_MAX = (1 << 64) - 1


class Tensor(NamedTuple):
    """A tensor named by value: which buffer, where in it, how many bytes."""

    buffer: int
    offset: int
    size: int

    def to_wire(self) -> list[int]:
        return [self.buffer, self.offset, self.size]


def as_tensor(t: Tensor | Sequence[int]) -> Tensor:
    """A Tensor, or the (buffer, offset, size) a caller gave for one, as a Tensor."""
    return t if type(t) is Tensor else Tensor(*t)


def _uint(value: Any, what: str, limit: int = U64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{what} must be an unsigned integer, got {type(value).__name__}")
    if value < 0 or value > limit:
        raise BadRequest(f"{what} = {value} is out of range 0..{limit}")
    return value


def field(body: dict[str, Any], name: str) -> Any:
    try:
        return body[name]
    except KeyError:
        raise BadRequest(f"missing field {name!r}") from None


def uint_field(body: dict[str, Any], name: str, limit: int = U64_MAX) -> int:
    return _uint(field(body, name), f"field {name!r}", limit)


def str_field(body: dict[str, Any], name: str, default: str | None = None) -> str:
    if name not in body and default is not None:
        return default
    value = field(body, name)
    if not isinstance(value, str):
        raise BadRequest(f"field {name!r} must be a string")
    return value


def bytes_field(body: dict[str, Any], name: str) -> bytes:
    value = field(body, name)
    if not isinstance(value, bytes | bytearray):
        raise BadRequest(f"field {name!r} must be binary")
    return bytes(value)


_mk = tuple.__new__


def fast_tensor(value: Any) -> Tensor | None:
    """The common case, checked without building error strings: None if unusual."""
    if type(value) is list and len(value) == 3:
        b, o, s = value
        if (
            type(b) is int
            and type(o) is int
            and type(s) is int
            and 0 <= b <= U64_MAX
            and 0 <= o <= U64_MAX
            and 0 <= s <= U64_MAX
        ):
            return _mk(Tensor, (b, o, s))  # Tensor(b, o, s) without its Python __new__
    return None


def tensor_from_wire(value: Any, what: str = "tensor") -> Tensor:
    t = fast_tensor(value)
    if t is not None:
        return t
    if not isinstance(value, list | tuple) or len(value) != 3:
        raise BadRequest(f"{what} must be [buffer, offset, size]")
    b, o, s = (_uint(v, f"{what}[{i}]") for i, v in enumerate(value))
    return Tensor(b, o, s)


def tensor_field(body: dict[str, Any], name: str) -> Tensor:
    t = fast_tensor(body.get(name))
    if t is not None:
        return t
    return tensor_from_wire(field(body, name), f"field {name!r}")


def tensors_field(body: dict[str, Any], name: str = "tensors") -> list[Tensor]:
    value = field(body, name)
    if not isinstance(value, list):
        raise BadRequest(f"field {name!r} must be a list of tensors")
    try:  # the common case in one pass; anything unusual takes the checked path
        fast = [
            Tensor(b, o, s)
            for b, o, s in value
            if type(b) is int
            and type(o) is int
            and type(s) is int
            and 0 <= b <= U64_MAX
            and 0 <= o <= U64_MAX
            and 0 <= s <= U64_MAX
        ]
        if len(fast) == len(value) and all(type(v) is list for v in value):
            return fast
    except (TypeError, ValueError):
        pass
    return [tensor_from_wire(v, f"{name}[{i}]") for i, v in enumerate(value)]
