"""Engine value types that cross the wire: NetAddr, MrDesc, Pages, ScatterDst.

They are plain frozen dataclasses with a stable byte form, so a client can
hand an MrDesc or a NetAddr to another client out of band (a KV-cache
scheduler, a trainer's rendezvous) and the other side can use it as is.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from .constants import MAX_RAILS
from .errors import BadRequest

_FORMAT = 1
U64 = (1 << 64) - 1


def _unpack(raw: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:
        raise BadRequest(f"{what}: not a valid serialised value") from None


# NetAddr's byte form: 2 lists each rail's address as opaque bytes (what its
# Domain says); 1 (read, never written) listed TCP [host, port] pairs.
_NETADDR_FORMAT = 2
MAX_RAIL_ADDR = 256


def tcp_rail(host: str, port: int) -> bytes:
    """The tcp Domain's address bytes for ``host:port`` (an IPv6 host in brackets)."""
    return (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode()


def _rail(r: Any) -> bytes:
    if isinstance(r, bytes | bytearray | memoryview):
        return bytes(r)
    host, port = r  # a (host, port) pair: the tcp Domain's address, as its bytes
    return tcp_rail(str(host), int(port))


@dataclass(frozen=True, slots=True)
class NetAddr:
    """Names a daemon's domain group (``node``, ``group``) and its rails.

    A main address lists every rail of the group; the NetAddr paired with an
    rkey in an MrDesc lists the one rail that rkey is valid on.  Each rail is
    the opaque address bytes of its Domain (only that Domain reads them: the
    tcp one's are ``b"host:port"``); a ``(host, port)`` pair given here is
    taken as a tcp address.
    """

    node: int
    group: int
    rails: tuple[bytes, ...]

    def __init__(self, node: int, group: int, rails: Sequence[Any]) -> None:
        object.__setattr__(self, "node", int(node))
        object.__setattr__(self, "group", int(group))
        object.__setattr__(self, "rails", tuple(_rail(r) for r in rails))

    def to_bytes(self) -> bytes:
        return msgpack.packb([_NETADDR_FORMAT, self.node, self.group, list(self.rails)])

    @classmethod
    def from_bytes(cls, raw: bytes) -> NetAddr:
        # Every submit names its destinations' NetAddrs: the same few, decoded once
        # (a NetAddr is immutable; a malformed one raises and is not cached).
        if type(raw) is bytes and cls is NetAddr:
            return _netaddr_cached(raw)
        return cls._decode(raw)

    @classmethod
    def _decode(cls, raw: bytes) -> NetAddr:
        v = _unpack(raw, "NetAddr")
        try:
            fmt, node, group, rails = v
            if type(node) is not int or type(group) is not int or not isinstance(rails, list):
                raise ValueError
            if len(rails) > MAX_RAILS:  # refused before a single rail is read
                raise ValueError
            if fmt == 1:
                return cls(node, group, [tcp_rail(str(h), int(p)) for h, p in rails])
            if fmt != _NETADDR_FORMAT or not all(
                    type(r) is bytes and 0 < len(r) <= MAX_RAIL_ADDR for r in rails):
                raise ValueError
            return cls(node, group, rails)
        except (TypeError, ValueError, OverflowError):  # int(inf) is an OverflowError
            raise BadRequest("NetAddr: malformed") from None

    def rail(self, i: int) -> NetAddr:
        return NetAddr(self.node, self.group, (self.rails[i],))

    @property
    def key(self) -> tuple[int, int]:
        """Identity of the peer domain group, whatever rails are listed."""
        return (self.node, self.group)

    def __str__(self) -> str:
        rails = ",".join(r.decode(errors="backslashreplace") for r in self.rails)
        return f"{self.node:016x}/{self.group}@{rails}"


# Bounded: the peers' addresses a daemon meets.
_netaddr_cached = functools.lru_cache(maxsize=1024)(NetAddr._decode)


@dataclass(frozen=True, slots=True, unsafe_hash=False, eq=True)
class MrDesc:
    """A remote memory region: its address and one (NetAddr, rkey) per rail."""

    ptr: int
    rkeys: list[tuple[NetAddr, int]]
    # The region's length, when known: lets an initiator refuse an
    # out-of-range write before sending it (the receiver checks regardless).
    size: int = 0

    def __init__(self, ptr: int, rkeys: Sequence[tuple[NetAddr, int]], size: int = 0) -> None:
        self._set(int(ptr), [(a, int(k)) for a, k in rkeys], int(size))

    def _set(self, ptr: int, keys: list[tuple[NetAddr, int]], size: int) -> None:
        # u64s, and a region inside the address space: a peer frame packs them as such
        # (out of range, its struct packing would fail in the link's send path).
        if ptr < 0 or size < 0 or ptr + size > U64:
            raise BadRequest(f"MrDesc: ptr {ptr} and size {size} must be u64, the region "
                             "[ptr, ptr + size) below 2**64")
        for _, k in keys:
            if not 0 <= k <= U64:
                raise BadRequest(f"MrDesc: rkey {k} is not a u64")
        object.__setattr__(self, "ptr", ptr)
        object.__setattr__(self, "rkeys", keys)
        object.__setattr__(self, "size", size)

    def to_wire(self) -> list[Any]:
        return [self.ptr, self.size, [[a.to_bytes(), k] for a, k in self.rkeys]]

    @classmethod
    def from_wire(cls, v: Any) -> MrDesc:
        try:
            ptr, size, rkeys = v
            # One rkey per rail, at most MAX_RAILS: counted before any is decoded (a 4 MiB
            # body of 140,000 rkeys decoded each NetAddr first, 1.4 s of the loop).
            if len(rkeys) > MAX_RAILS:
                raise BadRequest(f"MrDesc: {len(rkeys)} rkeys, at most {MAX_RAILS} (one per "
                                 "rail)")
            keys = [(NetAddr.from_bytes(a), k) for a, k in rkeys]
        except (TypeError, ValueError):
            raise BadRequest("MrDesc: malformed") from None
        # msgpack ints only: int() would take a float, a bool or a numeric string.
        if type(ptr) is not int or type(size) is not int:
            raise BadRequest("MrDesc: malformed (ptr and size are integers)")
        for _, k in keys:
            if type(k) is not int:
                raise BadRequest("MrDesc: malformed (every rkey is an integer)")
        desc = object.__new__(cls)
        desc._set(ptr, keys, size)
        return desc

    def to_bytes(self) -> bytes:
        return msgpack.packb([_FORMAT, *self.to_wire()])

    @classmethod
    def from_bytes(cls, raw: bytes) -> MrDesc:
        v = _unpack(raw, "MrDesc")
        if not isinstance(v, list) or len(v) != 4 or v[0] != _FORMAT:
            raise BadRequest("MrDesc: malformed")
        return cls.from_wire(v[1:])

    @property
    def node(self) -> tuple[int, int]:
        return self.rkeys[0][0].key if self.rkeys else (0, 0)


def _u32s(xs: Sequence[Any]) -> bool:
    """Every item an int in [0, 2**32) (page lists are long: no Python loop when all ints)."""
    if set(map(type, xs)) <= {int}:
        return not xs or (min(xs) >= 0 and max(xs) < 1 << 32)
    return all(isinstance(i, int) and 0 <= i < 1 << 32 for i in xs)


@dataclass(frozen=True, slots=True)
class Pages:
    """Pages at ``offset + index * stride`` for each index, as in the article."""

    indices: list[int]
    stride: int
    offset: int = 0

    def __init__(self, indices: Sequence[int], stride: int, offset: int = 0) -> None:
        ints = list(indices)
        if not set(map(type, ints)) <= {int}:  # thousands of pages: no Python loop if all ints
            ints = [int(i) for i in ints]
        object.__setattr__(self, "indices", ints)
        object.__setattr__(self, "stride", int(stride))
        object.__setattr__(self, "offset", int(offset))

    def address(self, k: int) -> int:
        return self.offset + self.indices[k] * self.stride

    def to_wire(self) -> list[Any]:
        return [list(self.indices), self.stride, self.offset]

    @classmethod
    def from_wire(cls, v: Any) -> Pages:
        try:
            indices, stride, offset = v
            if not _u32s(indices):
                raise ValueError
            # Integers only (a bool too, as for the indices: tests/unit/test_page_views.py):
            # int() would truncate a float into another page's address.
            if not isinstance(stride, int) or not isinstance(offset, int) or stride < 0 \
                    or offset < 0:
                raise ValueError
            return cls(indices, stride, offset)
        except (TypeError, ValueError, OverflowError):  # int(inf) is an OverflowError
            raise BadRequest("Pages: expected [indices (u32), stride, offset]") from None


@dataclass(frozen=True, slots=True)
class ScatterDst:
    """One destination of a scatter: ``len`` bytes from ``src`` to ``dst``."""

    len: int
    src: int
    dst: tuple[MrDesc, int]
