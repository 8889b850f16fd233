"""Planning a paged read: the local pages as views and the remote pages as addresses,
bounds checked from the extreme indices (reads.page_views, reads.plan_paged_reads)
exactly as page by page: the same views, the same OutOfBounds at one byte over."""

from __future__ import annotations

import random

import pytest

from transferd.engine.reads import page_views, plan_paged_reads
from transferd.engine.regions import RegionTable
from transferd.memory import Buffer
from transferd.protocol.errors import OutOfBounds
from transferd.protocol.values import MrDesc, NetAddr, Pages

SIZE = 1 << 20


@pytest.fixture
def region():  # type: ignore[no-untyped-def]
    b = Buffer.host(1, SIZE)
    b.view(0, SIZE)[:] = random.Random(0).randbytes(SIZE)
    r = RegionTable().register(b, 1)
    yield r
    b.release()


@pytest.mark.parametrize("stride,offset,page", [(4096, 0, 4096), (4096, 100, 3000),
                                                (10_000, 7, 1), (0, 5, 64)])
def test_page_views_are_region_views(region, stride: int, offset: int, page: int) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(stride)
    n = max(1, (SIZE - offset - page) // stride) if stride else 1
    idx = [rng.randrange(n) for _ in range(300)]
    got = page_views(region, Pages(idx, stride, offset), page)
    want = region.views([region.ptr + offset + i * stride for i in idx], page)
    assert [bytes(v) for v in got] == [bytes(v) for v in want]


def test_page_views_refuse_one_byte_over_either_edge(region) -> None:  # type: ignore[no-untyped-def]
    last = SIZE // 4096 - 1
    assert len(page_views(region, Pages([3, last, 0], 4096), 4096)) == 3  # the edges fit
    with pytest.raises(OutOfBounds):
        page_views(region, Pages([3, last, 0], 4096, 1), 4096)  # the last page: a byte over
    with pytest.raises(OutOfBounds):
        page_views(region, Pages([3, last], 4096), 4097)
    with pytest.raises(OutOfBounds):  # a negative stride (in-process Pages) reaching below 0
        page_views(region, Pages([0, 2], -4096, 4096), 4096)
    with pytest.raises(OutOfBounds):
        page_views(region, Pages([1], 4096, 0), -1)


def test_remote_pages_refused_one_byte_over_and_addressed_as_before() -> None:
    desc = MrDesc(0x7F00_0000_0000, [(NetAddr(1, 0, [("127.0.0.1", 1)]), 77)], SIZE)
    into = [memoryview(bytearray(4096)) for _ in range(3)]
    last = SIZE // 4096 - 1
    parts = plan_paged_reads(1, 4096, into, desc, Pages([last, 0, 5], 4096, 0), 1)
    assert parts[0].addrs == [desc.ptr + last * 4096, desc.ptr, desc.ptr + 5 * 4096]
    with pytest.raises(OutOfBounds, match=r"\[1044481, 1048577\)"):
        plan_paged_reads(1, 4096, into, desc, Pages([last, 0, 5], 4096, 1), 1)
    with pytest.raises(OutOfBounds):  # (a negative stride: one page, below the start)
        plan_paged_reads(1, 4096, into[:1], desc, Pages([1], -4096, 4095), 1)
