"""One-sided writes between real daemons with two rails each, over TCP and over the chaos
domain (out of order, random delays, every write in pieces): single and paged writes
checked by checksum, untouched memory unchanged, and ImmCounter under reordering."""

from __future__ import annotations

import asyncio
import random

import pytest

from client import Completion, MrDesc, NetAddr, Pages
from tests.helpers import async_test, digest
from tests.integration.engine_cluster import (
    RAILS,
    WAIT,
    Cluster,
    MiB,
    Node,
    Region,
    engine_env,
    fresh_imm,
    links_settle,
    nodes,
    poll,
    settle,
    start_many,
    tcp_rails,
)
from transferd.protocol.errors import BadRequest


def put(r: Region, offset: int, data: bytes) -> None:
    """Record what the test expects the remote buffer to hold now."""
    r.data[offset : offset + len(data)] = data


@async_test(timeout=60)
async def test_main_address_and_registration(tcp_cluster: Cluster) -> None:
    async with nodes(tcp_cluster.a, tcp_cluster.b) as (a, b):
        addr = await a.client.main_address()
        assert isinstance(addr, NetAddr)
        assert [h for h, _ in tcp_rails(addr)] == list(RAILS["a"])
        assert all(0 < p < 65536 for _, p in tcp_rails(addr))
        assert NetAddr.from_bytes(addr.to_bytes()) == addr
        # The same address the daemon printed at start-up.
        line = next(x for x in tcp_cluster.a.stdout_lines if x.startswith("transferd: engine "))
        assert NetAddr.from_bytes(bytes.fromhex(line.split("address ")[1])) == addr
        assert addr == await a.client.main_address()
        addr_b = await b.client.main_address()
        assert addr_b.key != addr.key

        r1 = await b.region(8192)
        r2 = await b.region(8192)
        for r in (r1, r2):
            assert r.desc.size == 8192 and r.desc.ptr != 0
            assert [n for n, _ in r.desc.rkeys] == [addr_b.rail(0), addr_b.rail(1)]
            assert all(0 < k < 2**64 for _, k in r.desc.rkeys)
            # It survives the out-of-band trip a scheduler would give it.
            assert MrDesc.from_bytes(r.desc.to_bytes()) == r.desc
        keys = [k for r in (r1, r2) for _, k in r.desc.rkeys]
        assert len(set(keys)) == 4
        assert r1.mr.id != r2.mr.id


@async_test(timeout=60)
async def test_single_write_small(cluster: Cluster) -> None:
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(64 * 1024, seed=1)
        dst = await b.region(64 * 1024, seed=2)
        imm = fresh_imm()
        for length, src_off, dst_off in [(1000, 0, 4097), (1, 5, 0), (4096, 8192, 60 * 1024),
                                         (777, 100, 64 * 1024 - 777)]:
            w = await a.client.submit_single_write(length, imm, (src.mr, src_off),
                                                    (dst.desc, dst_off))
            assert isinstance(w, Completion)
            await w.wait(WAIT)
            assert w.done() and w.exception() is None
            put(dst, dst_off, src.data[src_off : src_off + length])
        # Every write counted exactly once.
        assert await b.client.imm_count(imm) == 4
        await (await b.client.expect_imm_count(imm, 4, wait=False)).wait(WAIT)
        assert await b.client.imm_count(imm) == 0
        # The whole destination: the written ranges, and the pattern everywhere else.
        assert digest(await b.read(dst)) == digest(dst.data)


@async_test(timeout=60)
async def test_a_count_goes_to_the_expectation_still_awaited(tcp_cluster: Cluster) -> None:
    # The expecting side first: under TRANSFERD_TEST_INPROC it is the in-process engine.
    async with nodes(tcp_cluster.b, tcp_cluster.a) as (b, a):
        src = await a.region(4096, seed=5)
        dst = await b.region(4096)
        imm = fresh_imm()
        # Two expectations whose awaiters gave up: each is cancelled on the engine with
        # its Completion (given up once registered, and inside expect_imm_count).
        e = await b.client.expect_imm_count(imm, 1, wait=False, timeout=30)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(e, 0.2)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(b.client.expect_imm_count(imm, 1, timeout=30), 0.2)
        # One whose wait timed out is still there: wait() stops waiting, nothing more.
        kept = await b.client.expect_imm_count(imm, 1, wait=False, timeout=30)
        with pytest.raises(TimeoutError):
            await kept.wait(0.2)
        for _ in range(2):
            w = await a.client.submit_single_write(4096, imm, (src.mr, 0), (dst.desc, 0))
            await w.wait(WAIT)
        # The first count went to the expectation still awaited, the second is unclaimed.
        await kept.wait(WAIT)
        assert await b.client.imm_count(imm) == 1
        await (await b.client.expect_imm_count(imm, 1, wait=False)).wait(WAIT)
        assert await b.client.imm_count(imm) == 0
        assert await b.read(dst) == bytes(src.data)


@async_test(timeout=60)
async def test_write_without_immediate(cluster: Cluster) -> None:
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(4096, seed=3)
        dst = await b.region(4096)
        imm = fresh_imm()
        w = await a.client.submit_single_write(4096, None, (src.mr, 0), (dst.desc, 0))
        await w.wait(WAIT)
        assert await b.read(dst) == bytes(src.data)
        w = await a.client.submit_single_write(16, imm, (src.mr, 0), (dst.desc, 0))
        await w.wait(WAIT)
        assert await b.client.imm_count(imm) == 1  # only the write that carried one


@async_test(timeout=90)
async def test_single_write_split_over_rails(cluster: Cluster) -> None:
    size = 6 * MiB
    length = 3 * MiB + 12345  # large enough to be split over both rails, not aligned
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(size, seed=4)
        dst = await b.region(size, seed=5)
        imm = fresh_imm()
        got = asyncio.Event()
        e = await b.client.expect_imm_count(imm, 1, got.set)
        w = await a.client.submit_single_write(length, imm, (src.mr, 777), (dst.desc, 4099))
        await w.wait(WAIT)
        put(dst, 4099, src.data[777 : 777 + length])
        await asyncio.wait_for(got.wait(), WAIT)
        assert e.done()
        # However many parts carried it, it counted exactly once.
        assert await b.client.imm_count(imm) == 0
        assert digest(await b.read(dst)) == digest(dst.data)
        # A second one, back to back with a small one, same immediate.
        w1 = await a.client.submit_single_write(length, imm, (src.mr, 0), (dst.desc, 2 * MiB))
        w2 = await a.client.submit_single_write(10, imm, (src.mr, 5 * MiB), (dst.desc, 0))
        assert await settle([w1, w2]) == [None, None]
        put(dst, 2 * MiB, src.data[:length])
        put(dst, 0, src.data[5 * MiB : 5 * MiB + 10])
        assert await b.client.imm_count(imm) == 2
        assert digest(await b.read(dst)) == digest(dst.data)


@async_test(timeout=90)
async def test_paged_writes_random_indices(cluster: Cluster) -> None:
    rng = random.Random(6)
    page, n = 1000, 300
    src_stride, dst_stride, dst_offset = 1000, 1024, 24
    dst_slots = 1024
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(src_stride * 512, seed=7)
        dst = await b.region(dst_offset + dst_stride * dst_slots, seed=8)
        before = bytes(dst.data)
        src_idx = rng.sample(range(512), n)
        dst_idx = rng.sample(range(dst_slots), n)
        imm = fresh_imm()
        e = await b.client.expect_imm_count(imm, n, wait=False)
        w = await a.client.submit_paged_writes(
            page, imm, (src.mr, Pages(src_idx, src_stride)),
            (dst.desc, Pages(dst_idx, dst_stride, dst_offset)))
        await w.wait(WAIT)
        await e.wait(WAIT)  # one per page
        assert await b.client.imm_count(imm) == 0
        got = await b.read(dst)
        for s, d in zip(src_idx, dst_idx, strict=True):
            want = src.data[s * src_stride : s * src_stride + page]
            at = dst_offset + d * dst_stride
            assert digest(got[at : at + page]) == digest(want), f"page {d} (from {s})"
            put(dst, at, want)
        # Untouched slots, the gaps between pages and the head kept the pattern.
        written = set(dst_idx)
        for d in range(dst_slots):
            at = dst_offset + d * dst_stride
            if d not in written:
                assert got[at : at + dst_stride] == before[at : at + dst_stride], f"slot {d}"
            assert got[at + page : at + dst_stride] == before[at + page : at + dst_stride]
        assert got[:dst_offset] == before[:dst_offset]
        assert digest(got) == digest(dst.data)


@async_test(timeout=60)
async def test_paged_writes_of_4k_pages(cluster: Cluster) -> None:
    # KV-cache shaped: whole pages, same stride both sides, imm=None then with imm.
    rng = random.Random(9)
    page, slots = 4096, 256
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(page * slots, seed=10)
        dst = await b.region(page * slots, seed=11)
        imm = fresh_imm()
        ws = []
        for with_imm in (None, imm):
            si = rng.sample(range(slots), 64)
            di = rng.sample(range(slots), 64)
            ws.append(await a.client.submit_paged_writes(
                page, with_imm, (src.mr, Pages(si, page)), (dst.desc, Pages(di, page))))
            for s, d in zip(si, di, strict=True):
                put(dst, d * page, src.data[s * page : (s + 1) * page])
            await ws[-1].wait(WAIT)
        assert await b.client.imm_count(imm) == 64
        assert digest(await b.read(dst)) == digest(dst.data)
        # Zero pages: nothing moves, nothing counts, and it still completes.
        w = await a.client.submit_paged_writes(page, imm, (src.mr, Pages([], page)),
                                               (dst.desc, Pages([], page)))
        await w.wait(WAIT)
        assert await b.client.imm_count(imm) == 64


@async_test(timeout=90)
async def test_imm_count_under_reordering(cluster: Cluster) -> None:
    n, block = 64, 8192
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(n * block, seed=12)
        dst = await b.region(n * block, seed=13)
        imm = fresh_imm()
        fired = asyncio.Event()
        e = await b.client.expect_imm_count(imm, n, fired.set)
        order = list(range(n))
        random.Random(14).shuffle(order)
        ws = []
        for k in order[:-1]:
            ws.append(await a.client.submit_single_write(
                block, imm, (src.mr, k * block), (dst.desc, k * block)))
        assert await settle(ws) == [None] * (n - 1)
        # All but one landed: the counter shows them, the expectation has not fired.
        assert await b.client.imm_count(imm) == n - 1
        assert not e.done() and not fired.is_set()
        last = order[-1]
        w = await a.client.submit_single_write(block, imm, (src.mr, last * block),
                                               (dst.desc, last * block))
        await asyncio.wait_for(fired.wait(), WAIT)
        await w.wait(WAIT)
        # It fired once every byte was in place.
        assert digest(await b.read(dst)) == digest(src.data)
        assert await b.client.imm_count(imm) == 0


@async_test(timeout=90)
async def test_expectations_before_and_after_landing(cluster: Cluster) -> None:
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(64 * 1024, seed=15)
        dst = await b.region(64 * 1024)
        x, y = fresh_imm(), fresh_imm()
        ws: list[Completion] = []
        for i in range(5):
            imm = x if i % 2 == 0 else y  # x x x, y y, interleaved
            ws.append(await a.client.submit_single_write(
                4096, imm, (src.mr, i * 4096), (dst.desc, i * 4096)))
        # Poll the receiver's counters (nobody awaits the initiator's completions here).
        assert await poll(lambda: b.client.imm_count(x), 3) == 3
        assert await poll(lambda: b.client.imm_count(y), 2) == 2
        assert await settle(ws) == [None] * 5
        # Registered after the writes landed: fires at once, and consumes only y.
        await (await b.client.expect_imm_count(y, 2, wait=False)).wait(WAIT)
        assert await b.client.imm_count(y) == 0
        assert await b.client.imm_count(x) == 3
        # An expectation beyond what landed waits; one more write of x completes it.
        calls: list[str] = []
        e = await b.client.expect_imm_count(x, 4, lambda: calls.append("x4"))
        assert await b.client.imm_count(x) == 3
        assert not e.done() and calls == []
        # A later expectation of y is independent of x's.
        ey = await b.client.expect_imm_count(y, 1, wait=False)
        w = await a.client.submit_single_write(4096, y, (src.mr, 0), (dst.desc, 8 * 4096))
        await ey.wait(WAIT)
        assert not e.done()
        w = await a.client.submit_single_write(4096, x, (src.mr, 0), (dst.desc, 9 * 4096))
        await w.wait(WAIT)
        await e.wait(WAIT)
        await asyncio.sleep(0)
        assert calls == ["x4"]
        assert await b.client.imm_count(x) == 0


@async_test(timeout=60)
async def test_expectation_from_another_client_of_the_receiver(cluster: Cluster) -> None:
    # Counters belong to the daemon: a second client of B can expect what A wrote.
    async with nodes(cluster.a, cluster.b, cluster.b) as (a, b, b2):
        src = await a.region(4096, seed=16)
        dst = await b.region(4096)
        imm = fresh_imm()
        e = await b2.client.expect_imm_count(imm, 2, wait=False)
        for _ in range(2):
            await (await a.client.submit_single_write(
                4096, imm, (src.mr, 0), (dst.desc, 0))).wait(WAIT)
        await e.wait(WAIT)
        assert await b.client.imm_count(imm) == 0


@async_test(timeout=60)
async def test_writes_both_ways_at_once(cluster: Cluster) -> None:
    async with nodes(cluster.a, cluster.b) as (a, b):
        ra = await a.region(2 * MiB, seed=17)
        rb = await b.region(2 * MiB, seed=18)
        imm = fresh_imm()
        w_ab = await a.client.submit_single_write(MiB, imm, (ra.mr, 0), (rb.desc, MiB))
        w_ba = await b.client.submit_single_write(MiB, imm, (rb.mr, 0), (ra.desc, MiB))
        assert await settle([w_ab, w_ba]) == [None, None]
        assert await b.read(rb, MiB) == bytes(ra.data[:MiB])
        assert await a.read(ra, MiB) == bytes(rb.data[:MiB])
        assert await a.client.imm_count(imm) == 1
        assert await b.client.imm_count(imm) == 1


@async_test(timeout=60)
async def test_rails_each_bind_their_own_address() -> None:
    # Fresh daemons, so no other test's traffic has opened links between them yet.
    a_d, b_d = start_many([{"env": engine_env(RAILS["a"])}, {"env": engine_env(RAILS["b"])}])
    try:
        async with nodes(a_d, b_d) as (a, b):
            addr_b = await b.client.main_address()
            src = await a.region(4 * MiB, seed=19)
            dst = await b.region(4 * MiB)
            rails = tcp_rails(addr_b)
            assert links_settle(rails, lambda ls: not any(ls)) == [[], []]
            # A small write goes over one rail only ...
            await (await a.client.submit_single_write(
                100, None, (src.mr, 0), (dst.desc, 0))).wait(WAIT)
            seen = links_settle(rails, lambda ls: sum(map(len, ls)) == 1)
            assert sorted(map(len, seen)) == [0, 1], seen
            # ... a large one over both, each link from the matching rail of A.
            await (await a.client.submit_single_write(
                3 * MiB, None, (src.mr, 0), (dst.desc, 0))).wait(WAIT)
            seen = links_settle(rails, lambda ls: list(map(len, ls)) == [1, 1])
            assert list(map(len, seen)) == [1, 1], seen
            assert [remotes[0][0] for remotes in seen] == list(RAILS["a"]), seen
            # Links are reused: many more writes, still one connection per rail.
            ws = [await a.client.submit_single_write(2 * MiB, None, (src.mr, 0), (dst.desc, 0))
                  for _ in range(6)]
            assert await settle(ws) == [None] * 6
            again = links_settle(rails, lambda ls: ls == seen)
            assert again == seen
            assert await b.read(dst, 0, 3 * MiB) == bytes(src.data[: 3 * MiB])
    finally:
        a_d.stop()
        b_d.stop()
    assert a_d.returncode == 0 and b_d.returncode == 0, a_d.output() + b_d.output()


@pytest.mark.parametrize("n_clients", [3])
@async_test(timeout=90)
async def test_concurrent_clients_of_one_daemon(cluster: Cluster, n_clients: int) -> None:
    # Several clients of A write into disjoint slices of one region of B at once.
    per, block = 16, 16 * 1024
    async with nodes(cluster.b, *[cluster.a] * n_clients) as (b, *senders):
        dst = await b.region(n_clients * per * block, seed=20)
        imm = fresh_imm()
        e = await b.client.expect_imm_count(imm, n_clients * per, wait=False)

        async def one(i: int, node: Node) -> None:
            src = await node.region(per * block, seed=100 + i)
            c = node.client
            ws = [await c.submit_single_write(block, imm, (src.mr, k * block),
                                              (dst.desc, (i * per + k) * block))
                  for k in range(per)]
            assert await settle(ws) == [None] * per
            put(dst, i * per * block, bytes(src.data))

        await asyncio.gather(*(one(i, s) for i, s in enumerate(senders)))
        await e.wait(WAIT)
        assert digest(await b.read(dst)) == digest(dst.data)


@async_test(timeout=60)
async def test_edge_cases(cluster: Cluster) -> None:
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(64 * 1024, seed=21)
        dst = await b.region(64 * 1024, seed=22)
        imm = fresh_imm()
        # A zero-byte write (even at the very end) carries its immediate all the same.
        ws = [await a.client.submit_single_write(0, imm, (src.mr, 0), (dst.desc, 0)),
              await a.client.submit_single_write(0, imm, (src.mr, 0), (dst.desc, dst.size)),
              # Empty scatter and barrier: nothing to do, and done.
              await a.client.submit_scatter(None, imm, src.mr, []),
              await a.client.submit_barrier(None, imm, [])]
        assert await settle(ws) == [None] * 4
        assert await b.client.imm_count(imm) == 2
        # The largest immediate; out-of-range ones are refused.
        top = 0xFFFFFFFF
        before = await b.client.imm_count(top)
        await (await a.client.submit_single_write(1, top, (src.mr, 0), (dst.desc, 0))).wait(WAIT)
        assert await b.client.imm_count(top) == before + 1
        await (await b.client.expect_imm_count(top, before + 1, wait=False)).wait(WAIT)
        for bad in (1 << 32, -1):
            w = await a.client.submit_single_write(1, bad, (src.mr, 0), (dst.desc, 0))
            with pytest.raises(BadRequest):
                await w.wait(WAIT)
        # Many tiny pages (well over a frame's worth), one count each.
        imm2 = fresh_imm()
        w = await a.client.submit_paged_writes(16, imm2, (src.mr, Pages(range(2000), 16)),
                                               (dst.desc, Pages(range(2000), 32)))
        await w.wait(WAIT)
        assert await b.client.imm_count(imm2) == 2000
        got = await b.read(dst)
        dst.data[0:1] = src.data[0:1]
        for k in range(2000):
            dst.data[32 * k : 32 * k + 16] = src.data[16 * k : 16 * k + 16]
        assert digest(got) == digest(dst.data)
        # An expectation of zero is met at once.
        await (await b.client.expect_imm_count(fresh_imm(), 0, wait=False)).wait(WAIT)
