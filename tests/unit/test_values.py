"""Engine value types: NetAddr, MrDesc, Pages, ScatterDst round trips and malformed input."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

import client
from transferd.protocol.errors import BadRequest
from transferd.protocol.values import MrDesc, NetAddr, Pages, ScatterDst

A = NetAddr(0x0123456789ABCDEF, 0, (("127.0.0.2", 40001), ("127.0.0.3", 40002)))
B = NetAddr(2**64 - 1, 3, (("::1", 1), ("10.0.0.1", 65535), ("h", 2), ("h", 3)))


def desc(addr: NetAddr = A, ptr: int = 0x7F00_0000_1000, size: int = 1 << 20) -> MrDesc:
    return MrDesc(ptr, [(addr.rail(i), 0xFEED_0000_0000_0000 + i) for i in range(len(addr.rails))],
                  size)


# -- NetAddr --------------------------------------------------------------------------------


@pytest.mark.parametrize("addr", [A, B, NetAddr(1, 0, (("127.0.0.1", 0),))])
def test_netaddr_round_trip(addr: NetAddr) -> None:
    raw = addr.to_bytes()
    assert isinstance(raw, bytes)
    back = NetAddr.from_bytes(raw)
    assert back == addr
    assert hash(back) == hash(addr)
    assert back.to_bytes() == raw  # stable byte form


def test_netaddr_rail_and_key() -> None:
    r1 = A.rail(1)
    assert r1.rails == (b"127.0.0.3:40002",)  # the tcp Domain's address bytes
    assert r1.key == A.key == (A.node, A.group)
    assert A.rail(0) != A.rail(1)
    with pytest.raises(IndexError):
        A.rail(2)
    assert str(A) == "0123456789abcdef/0@127.0.0.2:40001,127.0.0.3:40002"


def test_netaddr_rails_are_opaque_bytes_and_format_1_still_reads() -> None:
    """Rails are each Domain's own bytes (format 2); format 1's [host, port] pairs (what
    earlier daemons wrote) read as tcp addresses."""
    inproc = NetAddr(5, 0, (b"\x00any bytes a Domain likes",))
    assert NetAddr.from_bytes(inproc.to_bytes()) == inproc
    old = msgpack.packb([1, 5, 0, [["127.0.0.2", 7], ["::1", 8]]])
    assert NetAddr.from_bytes(old).rails == (b"127.0.0.2:7", b"[::1]:8")
    assert msgpack.unpackb(A.to_bytes())[0] == 2
    for bad in ([2, 5, 0, [b""]], [2, 5, 0, [b"x" * 257]], [2, 5, 0, ["text"]]):
        with pytest.raises(BadRequest):
            NetAddr.from_bytes(msgpack.packb(bad))


def test_netaddr_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        A.node = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"\x94\x01",  # an array of 4 cut short
        msgpack.packb([1, 2, 3]),  # too few fields
        msgpack.packb([2, 1, 0, [["h", 1]]]),  # unknown format version
        msgpack.packb([1, 1, 0, [["h", 1, 2]]]),  # a rail is (host, port)
        msgpack.packb([1, 1, 0, [["h", "port"]]]),
        msgpack.packb([1, 1, 0, None]),
        msgpack.packb([1, "x", 0, []]),
        msgpack.packb({"node": 1}),
        msgpack.packb(7),
        msgpack.packb([1, 1, 0, [["h", 1]]]) + b"\x00",  # trailing garbage
    ],
)
def test_netaddr_malformed(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        NetAddr.from_bytes(raw)


# -- MrDesc ------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [desc(), desc(B, ptr=0, size=0), MrDesc(5, [])])
def test_mrdesc_round_trip(d: MrDesc) -> None:
    raw = d.to_bytes()
    back = MrDesc.from_bytes(raw)
    assert back == d
    assert back.ptr == d.ptr and back.size == d.size
    assert back.rkeys == d.rkeys
    assert MrDesc.from_wire(d.to_wire()) == d
    # It survives msgpack the way the protocol carries it (in a request body).
    assert MrDesc.from_wire(msgpack.unpackb(msgpack.packb(d.to_wire()))) == d


def test_mrdesc_fields() -> None:
    d = desc()
    assert isinstance(d.rkeys, list)
    assert [a for a, _ in d.rkeys] == [A.rail(0), A.rail(1)]
    assert all(0 <= k < 2**64 for _, k in d.rkeys)
    assert d.node == A.key
    # Any sequence of pairs is accepted.
    assert MrDesc(d.ptr, tuple(d.rkeys), d.size) == d
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.ptr = 0  # type: ignore[misc]


def test_mrdesc_rkey_is_u64() -> None:
    d = MrDesc(1, [(A.rail(0), 2**64 - 1)], 10)
    assert MrDesc.from_bytes(d.to_bytes()).rkeys[0][1] == 2**64 - 1


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 0, 0]),  # too short
        msgpack.packb([2, 0, 0, []]),  # unknown format
        msgpack.packb([1, 0, 0, [], 9]),  # too long
        msgpack.packb([1, "ptr", 0, []]),
        msgpack.packb([1, 0, 0, [[b"not a netaddr", 1]]]),
        msgpack.packb([1, 0, 0, [[A.rail(0).to_bytes(), "key"]]]),
        msgpack.packb([1, 0, 0, [[A.rail(0).to_bytes()]]]),
        msgpack.packb([1, 0, 0, [[7, 1]]]),  # the NetAddr is not bytes
        msgpack.packb([1, 0, 0, None]),
        msgpack.packb({"ptr": 0}),
        desc().to_bytes()[:-3],  # truncated
    ],
)
def test_mrdesc_malformed(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        MrDesc.from_bytes(raw)


@pytest.mark.parametrize("wire", [None, 5, [1, 2], [1, 2, 3, 4], [0, 0, [[b"x", 1]]], ["a", 0, []]])
def test_mrdesc_from_wire_malformed(wire: object) -> None:
    with pytest.raises(BadRequest):
        MrDesc.from_wire(wire)


# -- Pages, ScatterDst -------------------------------------------------------------------------


def test_pages() -> None:
    p = Pages([3, 0, 7], stride=4096, offset=100)
    assert p.indices == [3, 0, 7]
    assert Pages(range(3), 8).indices == [0, 1, 2]
    assert [p.address(k) for k in range(3)] == [100 + 3 * 4096, 100, 100 + 7 * 4096]
    assert Pages.from_wire(p.to_wire()) == p
    assert Pages.from_wire(msgpack.unpackb(msgpack.packb(p.to_wire()))) == p
    assert Pages([], 16).to_wire() == [[], 16, 0]
    assert Pages.from_wire([[2**32 - 1], 0, 0]).indices == [2**32 - 1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.stride = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "wire",
    [
        None,
        [[1], 16],  # no offset
        [[1], 16, 0, 0],
        [[-1], 16, 0],  # indices are u32
        [[2**32], 16, 0],
        [["1"], 16, 0],
        [[1.5], 16, 0],
        [[1], -16, 0],
        [[1], 16, -1],
        [[1], "16", 0],
        [5, 16, 0],
    ],
)
def test_pages_malformed(wire: object) -> None:
    with pytest.raises(BadRequest):
        Pages.from_wire(wire)


def test_scatter_dst_and_client_exports() -> None:
    d = desc()
    s = ScatterDst(100, 8, (d, 4096))
    assert (s.len, s.src, s.dst) == (100, 8, (d, 4096))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.len = 1  # type: ignore[misc]
    # The engine's value types are importable from the client package.
    assert client.MrDesc is MrDesc and client.NetAddr is NetAddr
    assert client.Pages is Pages and client.ScatterDst is ScatterDst
