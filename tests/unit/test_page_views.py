"""The page-list fast paths of the write path give what the page-by-page code gave.

Buffer.views / Region.views (one bounds check for a whole page list), the
equal-length fast path of the engine port's check of a peer write
(EnginePort.place), the WRITE header's own checks, and Pages.from_wire's
validation of long index lists.  (The send side's bookkeeping over a long list
of views, partly sent: tests/unit/test_link_io.py.)
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from typing import Any

import pytest

from transferd.engine.immcounter import ImmCounter
from transferd.engine.port import EnginePort
from transferd.engine.regions import Region, RegionTable
from transferd.memory import Buffer
from transferd.protocol.errors import BadRequest, NotFound, OutOfBounds
from transferd.protocol.peer_wire import WRITE_HEAD, encode_write, parse_write
from transferd.protocol.values import Pages

PAGE = 4096
PAGES = 64
SIZE = PAGE * PAGES


@pytest.fixture
def region() -> Iterator[Region]:
    buf = Buffer.host(1, SIZE)
    yield RegionTable().register(buf, 1)
    buf.release()


def test_buffer_views_match_view() -> None:
    buf = Buffer.host(1, SIZE)
    offs = random.Random(1).sample(range(0, SIZE, PAGE), 16)
    assert [bytes(v) for v in buf.views(offs, PAGE)] == [bytes(buf.view(o, PAGE)) for o in offs]
    assert buf.views([], PAGE) == []
    for bad in ([0, SIZE - PAGE + 1], [-1, 0]):
        with pytest.raises(OutOfBounds):
            buf.views(bad, PAGE)
    with pytest.raises(OutOfBounds):
        buf.views([0], -1)
    buf.release()
    with pytest.raises(NotFound):
        buf.views([0], PAGE)


def test_region_views_match_view(region: Region) -> None:
    p = region.ptr
    addrs = [p + i * PAGE for i in random.Random(2).sample(range(PAGES), PAGES)]
    views = region.views(addrs, PAGE)
    for a, v in zip(addrs, views, strict=True):
        v[:8] = a.to_bytes(8, "little")
    for a in addrs:
        assert bytes(region.view(a, 8)) == a.to_bytes(8, "little")


@pytest.mark.parametrize("bad", [-1, SIZE - PAGE + 1, SIZE])
def test_region_views_name_the_first_page_out(region: Region, bad: int) -> None:
    p = region.ptr
    addrs = [p, p + PAGE, p + bad, p + 2 * PAGE]
    with pytest.raises(OutOfBounds) as got:
        region.views(addrs, PAGE)
    with pytest.raises(OutOfBounds) as want:
        region.view(p + bad, PAGE)
    assert str(got.value) == str(want.value)


def _port(region: Region) -> EnginePort:
    table = RegionTable()
    table._by_rkey[region.rkeys[0]] = region
    return EnginePort(table, ImmCounter(), lambda *a: None, lambda s: None)


def _views(port: EnginePort, rkey: int, addrs: list[int], lens: list[int],
           payload: int) -> list[memoryview]:
    placed = port.place(rkey, 0, addrs, lens, payload, None)
    placed.release()  # a check only: whoever lands bytes holds it until they are in
    return list(placed.views)


def test_write_views_equal_pages_and_mixed_lengths_agree(region: Region) -> None:
    port = _port(region)
    p = region.ptr
    idx = random.Random(3).sample(range(PAGES), 32)
    addrs = [p + i * PAGE for i in idx]
    fast = _views(port, region.rkeys[0], addrs, [PAGE] * 32, 32 * PAGE)
    slow = [region.view(p + i * PAGE, PAGE) for i in idx]
    assert [v.tobytes() for v in fast] == [v.tobytes() for v in slow]
    assert len(_views(port, region.rkeys[0], addrs, [PAGE] * 31 + [8], 31 * PAGE + 8)) == 32
    with pytest.raises(BadRequest):
        _views(port, region.rkeys[0], addrs, [PAGE] * 32, 32 * PAGE - 1)
    with pytest.raises(OutOfBounds):
        _views(port, region.rkeys[0], [*addrs[:-1], p + SIZE], [PAGE] * 32, 32 * PAGE)
    assert region.admitted == 0


def test_a_write_header_that_lies_is_refused_typed() -> None:
    """A peer's header whose pages do not add up to its payload, or run past the end of
    the address space: BadRequest before any memory is looked at."""
    wire = bytearray(encode_write(1, 0, 5, [0x1000, 0x3000], [8, 8], None))
    struct.pack_into("<Q", wire, 40, 15)  # payload: 15, pages: 16
    with pytest.raises(BadRequest, match="payload"):
        parse_write(wire, 0, WRITE_HEAD.unpack_from(wire))
    wire = bytearray(encode_write(1, 0, 5, [(1 << 64) - 4], [8], None))
    with pytest.raises(BadRequest, match="address space"):
        parse_write(wire, 0, WRITE_HEAD.unpack_from(wire))


@pytest.mark.parametrize(
    "indices, ok",
    [
        ([0, 1, 2**32 - 1], True),
        ([], True),
        ([True, 3], True),  # bools were ints before, and still are
        ([-1, 2], False),
        ([0, 2**32], False),
        ([1.0, 2], False),
        (["1"], False),
        (None, False),
    ],
)
def test_pages_from_wire_validates_every_index(indices: Any, ok: bool) -> None:
    if ok:
        assert Pages.from_wire([indices, PAGE, 0]).indices == [int(i) for i in indices]
    else:
        with pytest.raises(BadRequest):
            Pages.from_wire([indices, PAGE, 0])
