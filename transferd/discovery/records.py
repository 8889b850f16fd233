"""What the directory holds and hands out: a name's value, a change, a node.

A leaf shared by the daemon and the client library (it imports only
:mod:`transferd.protocol`).  On the wire a value is two fields, ``kind`` and
``value``: ``"mr_desc"`` with ``MrDesc.to_bytes()``, ``"net_addr"`` with
``NetAddr.to_bytes()``, or ``"bytes"`` with the bytes themselves.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from transferd.protocol.errors import BadRequest
from transferd.protocol.values import MrDesc, NetAddr

Value = MrDesc | NetAddr | bytes


class Kind(enum.StrEnum):
    MR_DESC = "mr_desc"
    NET_ADDR = "net_addr"
    BYTES = "bytes"


def encode_value(value: Any) -> tuple[Kind, bytes]:
    """A value's kind and its bytes, as PUBLISH carries them."""
    if isinstance(value, MrDesc):
        return Kind.MR_DESC, value.to_bytes()
    if isinstance(value, NetAddr):
        return Kind.NET_ADDR, value.to_bytes()
    if isinstance(value, bytes | bytearray | memoryview):
        return Kind.BYTES, bytes(value)
    raise BadRequest(f"a published value is an MrDesc, a NetAddr or bytes, not "
                     f"{type(value).__name__}")


def check_kind(kind: Any) -> Kind:
    try:
        return Kind(kind)
    except ValueError:
        raise BadRequest(f"field 'kind' must be one of {', '.join(k.value for k in Kind)}, "
                         f"not {kind!r}") from None


def decode_value(kind: Any, data: bytes) -> Value:
    """The value of ``kind`` and ``data``; BadRequest when they do not parse."""
    if not isinstance(data, bytes | bytearray | memoryview):
        # Never bytes() of anything else: bytes(1 << 40) allocates a TiB of zeros.
        raise BadRequest(f"a name's value must be bytes, not {type(data).__name__}")
    k = check_kind(kind)
    if k is Kind.MR_DESC:
        return MrDesc.from_bytes(data)
    if k is Kind.NET_ADDR:
        return NetAddr.from_bytes(data)
    return bytes(data)


class Op(enum.StrEnum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class Change:
    """One change under a watched prefix: a name put (with its new value) or deleted
    (with the value it had).  ``node``: the node name of the daemon it was published
    through."""

    op: Op
    name: str
    value: Value | None
    node: str = ""

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Change:
        raw = body.get("value")
        value = None if raw is None else decode_value(body.get("kind"), raw)
        return cls(Op(body.get("op", "put")), str(body.get("name", "")), value,
                   str(body.get("node", "")))


@dataclass(frozen=True, slots=True)
class Peer:
    """A daemon alive in the cluster, as its node record says.

    Nothing here is believed over the peer handshake: a write to ``addr`` still
    goes only to a daemon that proves the cluster secret, and a link stays bound
    to the peer it authenticated (docs/discovery.md, "Trust").
    """

    name: str
    node: int
    addr: NetAddr | None
    version: tuple[int, int, int]
    rails: tuple[str, ...]
    capabilities: dict[str, Any] = field(default_factory=dict)
    urls: tuple[str, ...] = ()
    server: str = ""
    local: bool = False

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Peer:
        raw = body.get("addr")
        version = body.get("version") or (0, 0, 0)
        return cls(
            name=str(body.get("name", "")),
            node=int(body.get("node", 0) or 0),
            addr=NetAddr.from_bytes(raw) if raw else None,
            version=(int(version[0]), int(version[1]), int(version[2])),
            rails=tuple(str(r) for r in body.get("rails") or ()),
            capabilities=dict(body.get("capabilities") or {}),
            urls=tuple(str(u) for u in body.get("urls") or ()),
            server=str(body.get("server", "")),
            local=bool(body.get("local", False)),
        )
