"""Planning: single, paged and barrier writes sharded over rails, and the counting fields
each part carries (DESIGN.md's counting rules); split_sizes."""

from __future__ import annotations

import random

import pytest

from transferd.engine.plan import (
    PAGES_PER_FRAME,
    SPLIT_ALIGN,
    SPLIT_MIN,
    Plan,
    WritePart,
    plan_barrier,
    plan_paged,
    plan_single,
    split_sizes,
)
from transferd.protocol.errors import BadRequest, OutOfBounds
from transferd.protocol.values import MrDesc, NetAddr, Pages

PTR = 0x7F00_0000_0000
MiB = 1 << 20


def peer(rails: int, node: int = 0xB) -> NetAddr:
    return NetAddr(node, 0, tuple((f"127.0.0.{10 + i}", 5000 + i) for i in range(rails)))


def desc(rails: int, size: int = 64 * MiB, node: int = 0xB) -> MrDesc:
    a = peer(rails, node)
    return MrDesc(PTR, [(a.rail(i), 1000 + i) for i in range(rails)], size)


def src_of(n: int, seed: int = 0) -> memoryview:
    return memoryview(bytearray(random.Random(seed).randbytes(n)))


def joined(parts: list[WritePart]) -> bytes:
    return b"".join(bytes(v) for p in parts for v in p.src)


# -- split_sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [0, 1, 4095, 4096, 8192, 3 * 4096 - 1, MiB, MiB + 1, 10**7])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_split_sizes(length: int, n: int) -> None:
    sizes = split_sizes(length, n)
    assert sum(sizes) == length
    assert all(s >= 0 for s in sizes)
    if n == 1 or length < n * SPLIT_ALIGN:
        assert sizes == [length]  # too small to be worth splitting
    else:
        assert len(sizes) == n
        assert all(s % SPLIT_ALIGN == 0 for s in sizes[:-1])  # parts start aligned
        assert all(s > 0 for s in sizes)
        # Near equal: the last part takes the remainder, less than one alignment per part.
        assert sizes[-1] - sizes[0] < n * SPLIT_ALIGN


def test_split_sizes_align_1() -> None:
    assert split_sizes(5, 2, align=1) == [2, 3]
    assert split_sizes(8, 4, align=1) == [2, 2, 2, 2]
    assert split_sizes(3, 4, align=1) == [3]


# -- plan_single ------------------------------------------------------------------------------


def test_small_write_goes_whole_over_one_rail() -> None:
    d = desc(2)
    src = src_of(1000)
    (p,) = plan_single(1, 1000, 7, src, d, 64, 2)
    assert p.span is None and p.index == 0 and p.op == 1  # whole: counts 1, no span
    assert p.imm == 7
    assert p.addrs == [PTR + 64] and p.lens == [1000]
    assert bytes(p.src[0]) == bytes(src)
    assert (p.dst, p.rkey) == d.rkeys[p.rail]
    # Successive ops take turns on the rails.
    rails = {plan_single(op, 1000, 7, src, d, 0, 2)[0].rail for op in range(1, 5)}
    assert rails == {0, 1}


def test_just_below_split_min_is_one_part() -> None:
    src = src_of(SPLIT_MIN - 1)
    assert len(plan_single(3, len(src), 1, src, desc(4), 0, 4)) == 1
    src = src_of(SPLIT_MIN)
    assert len(plan_single(3, len(src), 1, src, desc(4), 0, 4)) == 4


@pytest.mark.parametrize("rails", [2, 3, 4])
@pytest.mark.parametrize("imm", [5, None])
def test_large_write_is_split_over_every_rail(rails: int, imm: int | None) -> None:
    length = 3 * MiB + 12345
    d = desc(rails)
    src = src_of(length, rails)
    parts = plan_single(9, length, imm, src, d, 4096, rails)
    assert len(parts) == rails
    assert sorted(p.rail for p in parts) == list(range(rails))
    assert [p.index for p in parts] == list(range(rails))
    for p in parts:
        assert p.op == 9
        assert (p.dst, p.rkey) == d.rkeys[p.rail]  # each part presents its rail's rkey
        assert p.imm == imm
        # Every part names the whole write: the receiver counts it once, when its parts
        # covered it (no count travels).
        assert p.span == [PTR + 4096, length]
        assert len(p.addrs) == len(p.lens) == len(p.src) == 1
    # Contiguous, in order, covering exactly the destination range.
    pos = PTR + 4096
    for p in parts:
        assert p.addrs[0] == pos
        pos += p.lens[0]
    assert pos == PTR + 4096 + length
    assert joined(parts) == bytes(src)
    assert sum(p.nbytes for p in parts) == length
    assert Plan(list(parts)).nbytes == length


def test_split_min_parameter() -> None:
    src = src_of(64 * 1024)
    assert len(plan_single(1, len(src), 1, src, desc(2), 0, 2)) == 1
    assert len(plan_single(1, len(src), 1, src, desc(2), 0, 2, split_min=4096)) == 2


def test_chaos_max_parts() -> None:
    d = desc(2)
    # A write big enough is cut into max_parts pieces, alternating rails.
    src = src_of(256 * 1024)
    parts = plan_single(1, len(src), 3, src, d, 0, 2, max_parts=8)
    assert len(parts) == 8
    assert {tuple(p.span or ()) for p in parts} == {(PTR, len(src))}
    assert {p.rail for p in parts} == {0, 1}
    assert joined(parts) == bytes(src)
    # Never pieces smaller than the alignment: 3 pages -> 3 parts; one page -> one part.
    src = src_of(3 * SPLIT_ALIGN)
    assert len(plan_single(1, len(src), 3, src, d, 0, 2, max_parts=8)) == 3
    src = src_of(100)
    assert len(plan_single(1, 100, 3, src, d, 0, 2, max_parts=8)) == 1
    # A large write is split at least over every rail, even with max_parts=1.
    src = src_of(2 * MiB)
    assert len(plan_single(1, len(src), 3, src, desc(4), 0, 4, max_parts=1)) == 4


def test_zero_length_write_is_one_empty_part() -> None:
    (p,) = plan_single(1, 0, 4, memoryview(b""), desc(2), 0, 2)
    assert p.lens == [0] and p.span is None and p.nbytes == 0


@pytest.mark.parametrize("have, want", [(1, 2), (2, 1), (2, 4), (4, 3)])
def test_rail_mismatch(have: int, want: int) -> None:
    src = src_of(10)
    with pytest.raises(BadRequest, match="rail count mismatch") as ei:
        plan_single(1, 10, 1, src, desc(have), 0, want)
    assert str(have) in str(ei.value) and str(want) in str(ei.value)
    with pytest.raises(BadRequest, match="rail count mismatch"):
        plan_paged(1, 10, 1, [src], desc(have), Pages([0], 10), want)
    with pytest.raises(BadRequest, match="rail count mismatch"):
        plan_barrier(1, 1, [desc(want), desc(have)], want)


def test_single_bounds_against_desc_size() -> None:
    d = desc(2, size=8192)
    src = src_of(4096)
    plan_single(1, 4096, None, src, d, 4096, 2)  # exactly up to the end: fine
    plan_single(1, 4096, None, src, d, 0, 2)
    with pytest.raises(OutOfBounds):
        plan_single(1, 4096, None, src, d, 4097, 2)  # one byte past the end
    with pytest.raises(OutOfBounds):
        plan_single(1, 4096, None, src, d, 8192, 2)
    with pytest.raises(OutOfBounds):
        plan_single(1, 8193, None, src_of(8193), d, 0, 2)
    # A desc without a size (0: unknown) leaves the check to the receiver.
    plan_single(1, 4096, None, src, desc(2, size=0), 10**9, 2)


def test_single_source_length_must_match() -> None:
    with pytest.raises(OutOfBounds):
        plan_single(1, 100, None, src_of(99), desc(1), 0, 1)
    with pytest.raises(OutOfBounds):
        plan_single(1, 100, None, src_of(101), desc(1), 0, 1)


# -- plan_paged -------------------------------------------------------------------------------


def pages_src(n: int, page: int) -> list[memoryview]:
    return [memoryview(bytes([i % 251]) * page) for i in range(n)]


@pytest.mark.parametrize("rails", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 3, 7, 600, 1000])
def test_paged_counts_one_per_page(rails: int, n: int) -> None:
    page = 64
    rng = random.Random(n * rails)
    indices = rng.sample(range(4 * n), n)
    dst = Pages(indices, stride=128, offset=32)
    d = desc(rails)
    views = pages_src(n, page)
    parts = plan_paged(5, page, 77, views, d, dst, rails)
    # Every page exactly once, at its address, with its own source view, in order.
    addrs = [a for p in parts for a in p.addrs]
    assert addrs == [PTR + 32 + i * 128 for i in indices]
    assert [v for p in parts for v in p.src] == views
    assert all(p.lens == [page] * len(p.addrs) for p in parts)
    # The receiver counts the pages each frame places; frames carry no span.
    assert sum(len(p.addrs) for p in parts) == n
    for p in parts:
        assert p.span is None and p.imm == 77 and p.op == 5
        assert len(p.addrs) <= PAGES_PER_FRAME
        assert (p.dst, p.rkey) == d.rkeys[p.rail]
    assert [p.index for p in parts] == list(range(len(parts)))
    # Sharded over every rail once there are enough pages, in contiguous blocks.
    used = [p.rail for p in parts]
    if n >= rails:
        assert set(used) == set(range(rails))
    else:
        assert len(set(used)) == 1  # fewer pages than rails: one rail
    blocks = [r for i, r in enumerate(used) if i == 0 or used[i - 1] != r]
    assert len(blocks) == len(set(used))


def test_paged_without_imm_counts_nothing() -> None:
    parts = plan_paged(1, 8, None, pages_src(5, 8), desc(2), Pages(range(5), 8), 2)
    assert all(p.imm is None and p.span is None for p in parts)
    assert sum(len(p.addrs) for p in parts) == 5


def test_paged_frames_of_at_most_n_pages() -> None:
    parts = plan_paged(1, 8, 1, pages_src(10, 8), desc(1), Pages(range(10), 8), 1,
                       pages_per_frame=3)
    assert [len(p.addrs) for p in parts] == [3, 3, 3, 1]
    # chaos: one page per frame
    parts = plan_paged(1, 8, 1, pages_src(10, 8), desc(2), Pages(range(10), 8), 2,
                       pages_per_frame=1)
    assert len(parts) == 10 and all(len(p.addrs) == 1 for p in parts)
    assert {p.rail for p in parts} == {0, 1}


def test_paged_zero_pages_is_empty() -> None:
    assert plan_paged(1, 8, 1, [], desc(2), Pages([], 8), 2) == []


def test_paged_mismatched_page_counts() -> None:
    with pytest.raises(BadRequest):
        plan_paged(1, 8, 1, pages_src(3, 8), desc(1), Pages([0, 1], 8), 1)


def test_paged_stride_smaller_than_page() -> None:
    with pytest.raises(BadRequest, match="stride"):
        plan_paged(1, 16, 1, pages_src(2, 16), desc(1), Pages([0, 1], 8), 1)
    # One page needs no stride.
    plan_paged(1, 16, 1, pages_src(1, 16), desc(1), Pages([0], 0), 1)


def test_paged_bounds_every_page() -> None:
    page = 4096
    d = desc(2, size=16 * page)
    last_ok = Pages([0, 15, 3], page)
    plan_paged(1, page, 1, pages_src(3, page), d, last_ok, 2)
    for bad in ([0, 16, 3], [16], [2**32 - 1]):
        with pytest.raises(OutOfBounds):
            plan_paged(1, page, 1, pages_src(len(bad), page), d, Pages(bad, page), 2)
    # The offset counts too: the last page with an offset of 1 goes one byte over.
    with pytest.raises(OutOfBounds):
        plan_paged(1, page, 1, pages_src(1, page), d, Pages([15], page, 1), 2)
    plan_paged(1, page - 1, 1, pages_src(1, page - 1), d, Pages([15], page, 1), 2)


# -- plan_barrier ------------------------------------------------------------------------------


def test_barrier_one_zero_byte_part_per_peer() -> None:
    peers = [desc(2, node=n) for n in (1, 2, 3)]
    parts = plan_barrier(4, 99, peers, 2)
    assert len(parts) == 3
    for i, (p, d) in enumerate(zip(parts, peers, strict=True)):
        assert p.imm == 99 and p.span is None
        # Zero bytes, but a valid descriptor: the destination region's address.
        assert p.addrs == [d.ptr] and p.lens == [0] and p.src == [] and p.nbytes == 0
        assert (p.dst, p.rkey) == d.rkeys[p.rail]
        assert p.index == i and p.op == 4
    assert {p.rail for p in parts} == {0, 1}
    assert plan_barrier(4, 99, [], 2) == []
