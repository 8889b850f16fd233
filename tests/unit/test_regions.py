"""RegionTable: rkeys (64-bit, random, distinct, per rail), revocation, bounds checks."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import pytest

from transferd.engine.regions import Region, RegionTable
from transferd.memory import Buffer
from transferd.protocol.errors import NotFound, OutOfBounds

SIZE = 64 * 1024


@pytest.fixture
def buf() -> Iterator[Buffer]:
    b = Buffer.host(1, SIZE)
    yield b
    b.release()


def test_register_gives_one_rkey_per_rail(buf: Buffer) -> None:
    table = RegionTable()
    for rails in (1, 2, 4):
        r = table.register(buf, rails)
        assert isinstance(r, Region)
        assert len(r.rkeys) == rails
        assert len(set(r.rkeys)) == rails
        assert all(0 < k < 2**64 for k in r.rkeys)
        assert r.ptr == buf.address and r.size == SIZE and r.buffer is buf
    assert len(table) == 3


def test_rkeys_are_64_bit_random_and_distinct(buf: Buffer) -> None:
    table = RegionTable()
    keys = [k for _ in range(64) for k in table.register(buf, 4).rkeys]
    assert len(set(keys)) == len(keys) == 256
    # Random 64-bit values, not counters: spread over the whole range, high bits set.
    assert sum(k >= 1 << 63 for k in keys) > 64
    assert sum(k < 1 << 32 for k in keys) < 4
    assert sorted(keys) != keys
    diffs = {b - a for a, b in itertools.pairwise(keys)}
    assert len(diffs) > 200  # no fixed stride
    # Two tables (two daemons) do not hand out the same keys.
    other = RegionTable()
    assert not set(other.register(buf, 4).rkeys) & set(keys)


def test_region_ids_are_distinct(buf: Buffer) -> None:
    table = RegionTable()
    ids = [table.register(buf, 1).id for _ in range(10)]
    assert len(set(ids)) == 10
    assert all(table.get(i).id == i for i in ids)
    with pytest.raises(NotFound):
        table.get(max(ids) + 1)


def test_by_rkey_checks_the_rail(buf: Buffer) -> None:
    table = RegionTable()
    r = table.register(buf, 2)
    k0, k1 = r.rkeys
    assert table.by_rkey(k0, 0) is r
    assert table.by_rkey(k1, 1) is r
    # An rkey is only valid on the rail it was issued for.
    with pytest.raises(NotFound):
        table.by_rkey(k0, 1)
    with pytest.raises(NotFound):
        table.by_rkey(k1, 0)
    with pytest.raises(NotFound):
        table.by_rkey(k0, 2)  # a rail the region has no key for
    for forged in (0, k0 ^ 1, k0 + 1, k1 ^ (1 << 63), 2**64 - 1):
        if forged not in (k0, k1):
            with pytest.raises(NotFound):
                table.by_rkey(forged, 0)


def test_deregister_revokes(buf: Buffer) -> None:
    table = RegionTable()
    r = table.register(buf, 2)
    keep = table.register(buf, 2)
    assert table.deregister(r.id) is r
    for rail, k in enumerate(r.rkeys):
        with pytest.raises(NotFound):
            table.by_rkey(k, rail)
    with pytest.raises(NotFound):
        table.get(r.id)
    with pytest.raises(NotFound):
        table.deregister(r.id)  # twice
    # The other region of the same buffer is untouched.
    assert table.by_rkey(keep.rkeys[1], 1) is keep
    assert table.regions_of(buf) == [keep]
    assert len(table) == 1


def test_regions_of(buf: Buffer) -> None:
    other = Buffer.host(2, 4096)
    try:
        table = RegionTable()
        a = table.register(buf, 1)
        b = table.register(other, 1)
        c = table.register(buf, 1)
        assert {x.id for x in table.regions_of(buf)} == {a.id, c.id}
        assert table.regions_of(other) == [b]
    finally:
        other.release()


def test_view_bounds(buf: Buffer) -> None:
    r = RegionTable().register(buf, 1)
    p, n = r.ptr, r.size
    assert len(r.view(p, n)) == n  # the whole region
    assert len(r.view(p + n - 1, 1)) == 1  # the last byte
    assert len(r.view(p + n, 0)) == 0  # empty, at the very end
    assert len(r.view(p, 0)) == 0
    for addr, length in [
        (p + n - 1, 2),  # one past the end
        (p + n, 1),
        (p - 1, 1),  # one before the start
        (p - 1, 2),
        (p, n + 1),
        (p, -1),
        (p + 10, -1),
        (0, 1),
        (p + n + 4096, 10),
        (p + 2**63, 1),
    ]:
        with pytest.raises(OutOfBounds):
            r.view(addr, length)


def test_view_writes_through_to_the_buffer(buf: Buffer) -> None:
    r = RegionTable().register(buf, 1)
    r.view(r.ptr + 100, 4)[:] = b"abcd"
    assert bytes(buf.view(100, 4)) == b"abcd"
    assert bytes(buf.view(96, 4)) == bytes(4)


def test_concurrent_register_and_deregister(buf: Buffer) -> None:
    table = RegionTable()
    seen: list[tuple[int, ...]] = []
    lock = threading.Lock()

    def work() -> None:
        mine = []
        for _ in range(200):
            mine.append(table.register(buf, 2))
        for r in mine[::2]:
            table.deregister(r.id)
        with lock:
            seen.extend(r.rkeys for r in mine)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    keys = [k for ks in seen for k in ks]
    assert len(keys) == len(set(keys)) == 4 * 200 * 2
    assert len(table) == 4 * 100
