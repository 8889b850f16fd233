"""The page-list fast paths of the write path give what the page-by-page code gave.

Buffer.views / Region.views (one bounds check for a whole page list), the
equal-length fast path of DomainGroup.write_views, Pages.from_wire's
validation of long index lists, and FramedStream._flush's bookkeeping when a
send takes only part of a long list of views.
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from transferd.domains.group import DomainGroup
from transferd.domains.stream import FramedStream
from transferd.engine.immcounter import ImmCounter
from transferd.engine.regions import Region, RegionTable
from transferd.memory import Buffer
from transferd.protocol.errors import BadRequest, NotFound, OutOfBounds
from transferd.protocol.frames import FrameDecoder
from transferd.protocol.peer import WriteHeader
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


def _group(region: Region) -> DomainGroup:
    table = RegionTable()
    table._by_rkey[region.rkeys[0]] = region
    return DomainGroup(0, 1, asyncio.new_event_loop(), table, ImmCounter(), lambda p, m, a: None)


PEER = (0xA, 0)


def _w(body: dict[str, Any]) -> WriteHeader:
    return WriteHeader.parse({"op": 1, "part": 0, **body})


def test_write_views_equal_pages_and_mixed_lengths_agree(region: Region) -> None:
    g = _group(region)
    p = region.ptr
    idx = random.Random(3).sample(range(PAGES), 32)
    body = {"rkey": region.rkeys[0], "addrs": [p + i * PAGE for i in idx], "lens": [PAGE] * 32}
    fast = g.write_views(0, PEER, _w(body), 32 * PAGE)
    slow = [region.view(p + i * PAGE, PAGE) for i in idx]
    assert [v.tobytes() for v in fast] == [v.tobytes() for v in slow]
    assert len(g.write_views(0, PEER, _w({**body, "lens": [PAGE] * 31 + [8]}),
                             31 * PAGE + 8)) == 32
    with pytest.raises(BadRequest):
        g.write_views(0, PEER, _w(body), 32 * PAGE - 1)
    with pytest.raises(OutOfBounds):
        g.write_views(0, PEER, _w({**body, "addrs": [*body["addrs"][:-1], p + SIZE]}),
                      32 * PAGE)
    # Not all ints (a float from a strange peer): refused by the parser, typed.
    floats: dict[str, Any] = {**body, "addrs": [float(a) for a in body["addrs"]]}
    with pytest.raises(BadRequest):
        _w(floats)
    g.loop.close()


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


def test_flush_keeps_order_across_partial_sends() -> None:
    """Hundreds of small views through a tiny send buffer arrive whole and in order."""
    loop = asyncio.new_event_loop()
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    got: list[Any] = []
    closed: list[Any] = []
    s = FramedStream(loop, a, on_frame=got.append, on_close=closed.append)
    data = [bytes([i % 251]) * (100 + i % 700) for i in range(900)]
    s.send(0x41, 0, 7, {"n": len(data)}, [memoryview(d) for d in data])
    assert s.queued > 0  # the send buffer cannot take it all at once

    b.setblocking(False)

    async def drain() -> list[Any]:
        dec = FrameDecoder()
        frames: list[Any] = []
        while not frames:
            await asyncio.sleep(0.001)  # the stream's writer callback runs meanwhile
            try:
                frames += dec.feed(b.recv(1 << 20))
            except BlockingIOError:
                continue
        return frames

    frames = loop.run_until_complete(asyncio.wait_for(drain(), 10))
    assert len(frames) == 1 and frames[0].seq == 7
    assert bytes(frames[0].payload) == b"".join(data)
    assert s.queued == 0
    s.close()
    b.close()
    loop.close()
    assert not got and closed == [None]


def test_send_skips_empty_views() -> None:
    loop = asyncio.new_event_loop()
    a, b = socket.socketpair()
    s = FramedStream(loop, a, on_frame=lambda f: None, on_close=lambda e: None)
    s.send(0x41, 0, 9, None, [memoryview(b""), memoryview(b"ab"), memoryview(b""),
                              memoryview(b"c")])
    assert s.queued == 0
    b.settimeout(5)
    frames = FrameDecoder().feed(b.recv(1 << 16))
    assert len(frames) == 1 and bytes(frames[0].payload or b"") == b"abc"
    s.close()
    b.close()
    loop.close()
