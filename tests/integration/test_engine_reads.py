"""One-sided READs between real daemons with two rails each (tcp, chaos out of order
and in pieces, tcp on worker threads): single and paged reads checked by checksum,
region edges, reads split over both rails, access rights (a write-only region reads
as an unknown rkey), revoked and forged rkeys, GATHER, deadline and CANCEL."""

from __future__ import annotations

import hashlib

import pytest

from client import Client, MrDesc, Pages
from tests.helpers import async_test, pattern
from tests.integration.engine_cluster import (
    RAILS,
    WAIT,
    Cluster,
    MiB,
    Node,
    Region,
    client_url,
    engine_env,
    nodes,
    start_many,
)
from transferd.protocol.errors import BadRequest, NotFound, OutOfBounds, OverLimit


async def region(n: Node, size: int, seed: int | None = None, access: str = "w") -> Region:
    """A registered buffer with ``access`` rights for peers, filled with a pattern."""
    buf = await n.client.alloc_buffer(size)
    n.buffers.append(buf)
    data = bytearray(size) if seed is None else bytearray(pattern(size, seed))
    if seed is not None:
        await n.client.set_tensor(buf.tensor(), data)
    mr, desc = await n.client.reg_mr(buf, access=access)
    return Region(buf, mr, desc, data)


def sha(b: bytes | bytearray) -> str:
    return hashlib.sha256(b).hexdigest()


@async_test(timeout=90)
async def test_single_read_checksums_and_edges(cluster: Cluster) -> None:
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await region(b, 4 * MiB, seed=7, access="r")
        dst = await region(a, 4 * MiB, seed=8)
        expect = bytearray(dst.data)
        # Small, unaligned, at both edges of both regions, and split over the rails.
        for length, dst_off, src_off in [(1, 0, 0), (4096, 4097, 123),
                                         (777, 4 * MiB - 777, 4 * MiB - 777),
                                         (3 * MiB + 5, 1, 0), (4 * MiB, 0, 0)]:
            r = await a.client.submit_single_read(length, (dst.mr, dst_off),
                                                  (src.desc, src_off))
            await r.wait(WAIT)
            expect[dst_off:dst_off + length] = src.data[src_off:src_off + length]
            got = await a.read(dst)
            assert sha(got) == sha(expect), (length, dst_off, src_off)
        # The source is untouched by being read.
        assert sha(await b.read(src)) == sha(src.data)


@async_test(timeout=90)
async def test_paged_reads_checksums(cluster: Cluster) -> None:
    async with nodes(cluster.a, cluster.b) as (a, b):
        page = 16 * 1024
        src = await region(b, 1024 * page, seed=3, access="rw")
        dst = await region(a, 1100 * page)
        # 600 pages (several frames per rail), scattered on both sides, one stride apart.
        sidx = [(i * 7) % 1024 for i in range(600)]
        didx = list(reversed(range(600)))
        r = await a.client.submit_paged_reads(page, (dst.mr, Pages(didx, page, 100)),
                                              (src.desc, Pages(sidx, page, 0)))
        await r.wait(WAIT)
        got = await a.read(dst)
        for d, s in zip(didx, sidx, strict=True):
            so = s * page
            assert got[100 + d * page:100 + (d + 1) * page] == src.data[so:so + page]
        assert got[:100] == bytes(100)  # before the first page: untouched


@async_test(timeout=60)
async def test_rights_and_rkeys(tcp_cluster: Cluster) -> None:
    async with nodes(tcp_cluster.a, tcp_cluster.b) as (a, b):
        wonly = await region(b, 64 * 1024, seed=1)               # "w": peers may not read
        ronly = await region(b, 64 * 1024, seed=2, access="r")   # peers may not write
        dst = await region(a, 64 * 1024, seed=9)
        messages = []
        for desc in (wonly.desc, MrDesc(ronly.desc.ptr, [(ad, k ^ 1) for ad, k in
                                                          ronly.desc.rkeys], ronly.desc.size)):
            r = await a.client.submit_single_read(4096, (dst.mr, 0), (desc, 0))
            with pytest.raises(NotFound) as ei:
                await r.wait(WAIT)
            messages.append(ei.value.message)
        # A write-only region and a forged rkey answer alike: nothing tells them apart.
        assert messages[0] == messages[1]
        # A write into the read-only region is refused as an unknown rkey too.
        w = await a.client.submit_single_write(4096, None, (dst.mr, 0), (ronly.desc, 0))
        with pytest.raises(NotFound):
            await w.wait(WAIT)
        assert await b.read(ronly) == bytes(ronly.data)
        # Past the region's end: refused before anything moves.
        for dst_off, src_off in ((0, 62 * 1024), (62 * 1024, 0)):
            r = await a.client.submit_single_read(4096, (dst.mr, dst_off),
                                                  (ronly.desc, src_off))
            with pytest.raises(OutOfBounds):
                await r.wait(WAIT)
        with pytest.raises(BadRequest):
            await b.client.reg_mr(ronly.buf, access="x")
        # Revoked: deregistered, its rkeys read as unknown.
        await b.client.dereg_mr(ronly.mr)
        r = await a.client.submit_single_read(4096, (dst.mr, 0), (ronly.desc, 0))
        with pytest.raises(NotFound):
            await r.wait(WAIT)
        assert await a.read(dst) == bytes(dst.data)  # nothing landed from any of them


@async_test(timeout=60)
async def test_gather(tcp_cluster: Cluster) -> None:
    async with nodes(tcp_cluster.a, tcp_cluster.b, tcp_cluster.c) as (a, b, c):
        sb = await region(b, 2 * MiB, seed=4, access="r")
        sc = await region(c, 64 * 1024, seed=5, access="r")
        dst = await region(a, 4 * MiB)
        r = await a.client.submit_gather(dst.mr, [(2 * MiB, 0, sb.desc, 0),
                                                  (1000, 3 * MiB, sc.desc, 17)])
        await r.wait(WAIT)
        got = await a.read(dst)
        assert sha(got[:2 * MiB]) == sha(sb.data)
        assert got[3 * MiB:3 * MiB + 1000] == sc.data[17:1017]


@async_test(timeout=60)
async def test_a_gather_one_source_over_the_cap_is_refused_whole() -> None:
    """engine.max_scatter_dsts (here 4) bounds a GATHER's sources as it bounds a
    SCATTER's destinations: a fifth refuses it whole with TOO_LARGE (the wire's count
    before decoding: test_caps.py), nothing read; four land, byte for byte, and the
    connection goes on."""
    ds = start_many([{"env": engine_env(RAILS[n], max_scatter_dsts=4)} for n in "ab"])
    try:
        async with nodes(*ds) as (a, b):
            sb = await region(b, 4096, seed=61, access="r")
            dst = await region(a, 4096)
            five = [(16, 16 * i, sb.desc, 100 + 16 * i) for i in range(5)]
            r = await a.client.submit_gather(dst.mr, five)
            with pytest.raises(OverLimit, match=r"5 sources.*max_scatter_dsts"):
                await r.wait(WAIT)
            assert sha(await a.read(dst)) == sha(bytes(4096))  # nothing of it read
            r = await a.client.submit_gather(dst.mr, five[:4])
            await r.wait(WAIT)
            got = await a.read(dst)
            for i in range(4):
                assert got[16 * i:16 * i + 16] == sb.data[100 + 16 * i:116 + 16 * i]
            assert got[64:] == bytes(4096 - 64)
    finally:
        for d in ds:
            d.stop()


@async_test(timeout=60)
async def test_a_read_of_a_region_being_written_gets_old_or_new_bytes(
    tcp_cluster: Cluster
) -> None:
    """No atomicity (documented): each byte read is the old or the new one, never other."""
    async with nodes(tcp_cluster.a, tcp_cluster.b, tcp_cluster.c) as (a, b, c):
        size = 8 * MiB
        target = await region(b, size, access="rw")            # zeros: the old bytes
        new = await region(c, size, seed=41)                     # what C writes into it
        dst = await region(a, size, seed=42)
        w = await c.client.submit_single_write(size, None, (new.mr, 0), (target.desc, 0))
        r = await a.client.submit_single_read(size, (dst.mr, 0), (target.desc, 0))
        await w.wait(WAIT)
        await r.wait(WAIT)
        got = await a.read(dst)
        mixed = sum(1 for i in range(0, size, 4096) if got[i:i + 4096] not in (
            bytes(4096), bytes(new.data[i:i + 4096])))
        odd = [i for i in range(0, size, 997) if got[i] not in (0, new.data[i])]
        assert not odd, odd[:5]
        print(f"{mixed} page(s) of the read mixed old and new bytes")
        assert await b.read(target) == bytes(new.data)


@async_test(timeout=60)
async def test_freed_and_connection_owned_regions_are_revoked_for_readers(
    tcp_cluster: Cluster
) -> None:
    async with nodes(tcp_cluster.a, tcp_cluster.b) as (a, b):
        dst = await region(a, 64 * 1024)
        src = await region(b, 64 * 1024, seed=43, access="r")
        await (await a.client.submit_single_read(100, (dst.mr, 0), (src.desc, 0))).wait(WAIT)
        await b.client.free_buffer(src.buf)
        b.buffers.remove(src.buf)
        r = await a.client.submit_single_read(100, (dst.mr, 0), (src.desc, 0))
        with pytest.raises(NotFound):
            await r.wait(WAIT)
        # A connection's buffer goes with the connection, and its read rights with it.
        # (A client of B's daemon itself, never an in-process engine in its place.)
        async with await Client.connect(client_url(tcp_cluster.b), timeout=WAIT) as b2:
            buf = await b2.alloc_buffer(4096, owner="connection")
            _, desc = await b2.reg_mr(buf, access="r")
            await (await a.client.submit_single_read(4096, (dst.mr, 0), (desc, 0))).wait(WAIT)
        r = await a.client.submit_single_read(4096, (dst.mr, 0), (desc, 0))
        with pytest.raises(NotFound):
            await r.wait(WAIT)


def test_the_blocking_client_reads(tcp_cluster: Cluster) -> None:
    from client import SyncClient

    with SyncClient.connect(tcp_cluster.a.url) as a, SyncClient.connect(tcp_cluster.b.url) as b:
        assert "read" in a.features
        src = b.alloc_buffer(1 << 20)
        data = pattern(1 << 20, 44)
        b.set_tensor(src.tensor(), data)
        _, desc = b.reg_mr(src, access="r")
        dst = a.alloc_buffer(1 << 20)
        mr, _ = a.reg_mr(dst)
        try:
            a.wait(a.submit_single_read(1 << 20, (mr, 0), (desc, 0)), WAIT)
            a.wait(a.submit_paged_reads(4096, (mr, Pages([0, 1], 4096)),
                                        (desc, Pages([3, 2], 4096))), WAIT)
            got = bytes(a.get_tensor(dst.tensor()))
            assert got[8192:] == data[8192:]
            assert got[:4096] == data[3 * 4096:4 * 4096]
            assert got[4096:8192] == data[2 * 4096:3 * 4096]
        finally:
            a.free_buffer(dst)
            b.free_buffer(src)


@async_test(timeout=60)
async def test_the_responder_counts_what_it_served_and_refused(tcp_cluster: Cluster) -> None:
    from tests.helpers import metric, scrape

    async with nodes(tcp_cluster.a, tcp_cluster.b) as (a, b):
        url = tcp_cluster.b.metrics_url or ""
        before = scrape(url)
        src = await region(b, 64 * 1024, seed=45, access="r")
        wonly = await region(b, 4096)
        dst = await region(a, 64 * 1024)
        await (await a.client.submit_single_read(5000, (dst.mr, 0), (src.desc, 0))).wait(WAIT)
        r = await a.client.submit_single_read(100, (dst.mr, 0), (wonly.desc, 0))
        with pytest.raises(NotFound):
            await r.wait(WAIT)
        after = scrape(url)
        assert metric(after, "transferd_engine_served_reads_total") - metric(
            before, "transferd_engine_served_reads_total") == 1
        assert metric(after, "transferd_engine_served_read_bytes_total") - metric(
            before, "transferd_engine_served_read_bytes_total") == 5000
        name = "transferd_engine_refused_reads_total"
        assert metric(after, name, reason="NOT_FOUND") - metric(before, name,
                                                               reason="NOT_FOUND") == 1
        assert "peer read refused" in tcp_cluster.b.stderr
