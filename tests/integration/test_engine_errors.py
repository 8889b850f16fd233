"""Writes the receiving daemon must refuse (forged rkeys, out-of-range pages, revoked
regions) leave its memory and counters unchanged and fail the initiator's Completion with
the typed error; SYNCHRONIZE waits for engine submits; a client that vanishes with
transfers in flight hurts nobody."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from client import Client, MrDesc, Pages
from tests.helpers import RawConn, async_test, digest
from tests.integration.engine_cluster import (
    SECRET,
    WAIT,
    Cluster,
    MiB,
    client_url,
    fresh_imm,
    nodes,
    poll,
    settle,
    stopped,
    tcp_rails,
    wait_connections,
)
from tests.integration.fake_peer import FakePeer, data_frame, handshake_error, raw_write
from transferd.engine.limits import MAX_MESSAGE
from transferd.protocol.errors import BadRequest, ConnectionLost, NotFound, OutOfBounds
from transferd.protocol.peer import PeerCommand


def forged(desc: MrDesc, how: str) -> MrDesc:
    """``desc`` with rkeys it does not own, or lying about its size."""
    if how == "flipped":
        return MrDesc(desc.ptr, [(a, k ^ 0x5A5A_0000_0001) for a, k in desc.rkeys], desc.size)
    if how == "swapped":  # each rail given the other rail's (valid) rkey
        keys = [k for _, k in desc.rkeys][::-1]
        return MrDesc(desc.ptr, [(a, k) for (a, _), k in zip(desc.rkeys, keys, strict=True)],
                      desc.size)
    if how == "unsized":  # the initiator cannot check bounds: the receiver must
        return MrDesc(desc.ptr, desc.rkeys, 0)
    if how == "before":  # a region said to start a page before the real one
        return MrDesc(desc.ptr - 4096, desc.rkeys, 0)
    raise ValueError(how)


@pytest.mark.parametrize("how", ["flipped", "swapped"])
@async_test(timeout=60)
async def test_forged_rkey_is_refused(cluster: Cluster, how: str) -> None:
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(4 * MiB, seed=40)
        dst = await b.region(4 * MiB, seed=41)
        bad = forged(dst.desc, how)
        imm = fresh_imm()
        ws = [
            await a.client.submit_single_write(1000, imm, (src.mr, 0), (bad, 0)),
            await a.client.submit_single_write(2 * MiB, imm, (src.mr, 0), (bad, MiB)),
            await a.client.submit_paged_writes(4096, imm, (src.mr, Pages([0, 1, 2], 4096)),
                                               (bad, Pages([9, 3, 5], 4096))),
            await a.client.submit_barrier(None, imm, [bad]),
        ]
        errors = await settle(ws)
        assert all(isinstance(e, NotFound) for e in errors), errors
        assert "rkey" in str(errors[0])
        # Nothing landed and nothing was counted.
        assert await b.client.imm_count(imm) == 0
        assert digest(await b.read(dst)) == digest(dst.data)
        # The genuine desc still works.
        w = await a.client.submit_single_write(1000, imm, (src.mr, 0), (dst.desc, 0))
        await w.wait(WAIT)
        assert await b.client.imm_count(imm) == 1


@async_test(timeout=60)
async def test_out_of_range_refused_by_the_initiator(cluster: Cluster) -> None:
    page = 4096
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(16 * page, seed=42)
        dst = await b.region(16 * page, seed=43)
        imm = fresh_imm()
        size = dst.size
        # The region's size travels in the MrDesc: refused before anything is sent.
        cases = [
            a.client.submit_single_write(1000, imm, (src.mr, 0), (dst.desc, size - 999)),
            a.client.submit_single_write(1, imm, (src.mr, 0), (dst.desc, size)),
            a.client.submit_paged_writes(page, imm, (src.mr, Pages([0, 1], page)),
                                         (dst.desc, Pages([3, 16], page))),
            a.client.submit_paged_writes(page, imm, (src.mr, Pages([0], page)),
                                         (dst.desc, Pages([15], page, 1))),
            # A source range outside the initiator's own region.
            a.client.submit_single_write(1000, imm, (src.mr, src.size - 999), (dst.desc, 0)),
            a.client.submit_paged_writes(page, imm, (src.mr, Pages([16], page)),
                                         (dst.desc, Pages([0], page))),
        ]
        ws = [await c for c in cases]
        errors = await settle(ws)
        assert all(isinstance(e, OutOfBounds) for e in errors), errors
        assert await b.client.imm_count(imm) == 0
        assert digest(await b.read(dst)) == digest(dst.data)
        # Exactly up to the end is fine (off by one the other way).
        w1 = await a.client.submit_single_write(1000, imm, (src.mr, 0), (dst.desc, size - 1000))
        # w2 overwrites w1's range: on an unordered transport it must wait for w1.
        assert await settle([w1]) == [None]
        w2 = await a.client.submit_paged_writes(page, imm, (src.mr, Pages([2], page)),
                                                (dst.desc, Pages([15], page)))
        assert await settle([w2]) == [None]
        dst.data[size - page :] = src.data[2 * page : 3 * page]
        assert await b.client.imm_count(imm) == 2
        assert digest(await b.read(dst)) == digest(dst.data)


@async_test(timeout=60)
async def test_a_destination_rail_with_no_address_is_refused_typed(cluster: Cluster) -> None:
    # An MrDesc whose rail entry names a NetAddr of no rail address: every submit that
    # takes a destination refuses it (BAD_REQUEST), none reaches the Domain (it was an
    # IndexError there, an INTERNAL answer, and the transfer left to time out).
    from transferd.protocol.values import NetAddr, ScatterDst

    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(16 * 4096, seed=44)
        dst = await b.region(16 * 4096, seed=45)
        hollow = MrDesc(dst.desc.ptr, [(NetAddr(a0.node, a0.group, ()), k)
                                       for a0, k in dst.desc.rkeys], dst.desc.size)
        imm = fresh_imm()
        ws = [
            await a.client.submit_single_write(100, imm, (src.mr, 0), (hollow, 0)),
            await a.client.submit_paged_writes(4096, imm, (src.mr, Pages([0], 4096)),
                                               (hollow, Pages([1], 4096))),
            await a.client.submit_barrier(None, imm, [hollow]),
            await a.client.submit_scatter(None, imm, src.mr,
                                          [ScatterDst(100, 0, (hollow, 0))]),
        ]
        errors = await settle(ws)
        assert all(isinstance(e, BadRequest) and "no rail address" in str(e)
                   for e in errors), errors
        assert await b.client.imm_count(imm) == 0
        # The daemon goes on: a good write lands.
        assert await settle([await a.client.submit_single_write(
            100, imm, (src.mr, 0), (dst.desc, 0))]) == [None]


@async_test(timeout=60)
async def test_out_of_range_refused_by_the_receiver(cluster: Cluster) -> None:
    page = 4096
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(16 * page, seed=44)
        dst = await b.region(16 * page, seed=45)
        # Another region right after it must not be reachable either.
        after = await b.region(16 * page, seed=46)
        imm = fresh_imm()
        unsized, before = forged(dst.desc, "unsized"), forged(dst.desc, "before")
        size = dst.size
        ws = [
            # One byte over the end.
            await a.client.submit_single_write(page, imm, (src.mr, 0), (unsized, size - page + 1)),
            await a.client.submit_single_write(1, imm, (src.mr, 0), (unsized, size)),
            await a.client.submit_single_write(page, imm, (src.mr, 0), (unsized, 1 << 40)),
            # A page one index past the end; a page straddling the end.
            await a.client.submit_paged_writes(page, imm, (src.mr, Pages([0], page)),
                                               (unsized, Pages([16], page))),
            await a.client.submit_paged_writes(page, imm, (src.mr, Pages([0], page)),
                                               (unsized, Pages([15], page, 1))),
            # Before the start.
            await a.client.submit_single_write(page, imm, (src.mr, 0), (before, 0)),
            await a.client.submit_single_write(1, imm, (src.mr, 0), (before, page - 1)),
        ]
        errors = await settle(ws)
        assert all(isinstance(e, OutOfBounds) for e in errors), errors
        assert await b.client.imm_count(imm) == 0
        assert digest(await b.read(dst)) == digest(dst.data)
        assert digest(await b.read(after)) == digest(after.data)
        # The very last byte and the very first, through the same unchecked descs.
        ws = [await a.client.submit_single_write(1, imm, (src.mr, 7), (unsized, size - 1)),
              await a.client.submit_single_write(1, imm, (src.mr, 8), (before, page))]
        assert await settle(ws) == [None, None]
        dst.data[-1:] = src.data[7:8]
        dst.data[:1] = src.data[8:9]
        assert digest(await b.read(dst)) == digest(dst.data)
        assert await b.client.imm_count(imm) == 2


@async_test(timeout=60)
async def test_dereg_revokes(cluster: Cluster) -> None:
    async with nodes(cluster.a, cluster.b) as (a, b):
        src = await a.region(64 * 1024, seed=47)
        dst = await b.region(64 * 1024, seed=48)
        imm = fresh_imm()
        await (await a.client.submit_single_write(100, imm, (src.mr, 0), (dst.desc, 0))).wait(WAIT)
        dst.data[:100] = src.data[:100]
        await b.client.dereg_mr(dst.mr)
        with pytest.raises(NotFound):
            await b.client.dereg_mr(dst.mr)  # twice
        ws = [await a.client.submit_single_write(100, imm, (src.mr, 100), (dst.desc, 100)),
              await a.client.submit_paged_writes(1024, imm, (src.mr, Pages([1], 1024)),
                                                 (dst.desc, Pages([5], 1024))),
              await a.client.submit_barrier(None, imm, [dst.desc])]
        errors = await settle(ws)
        assert all(isinstance(e, NotFound) for e in errors), errors
        assert await b.client.imm_count(imm) == 1
        assert digest(await b.read(dst)) == digest(dst.data)
        # Registering again gives new rkeys; the old desc stays dead.
        _, desc2 = await b.client.reg_mr(dst.buf)
        assert {k for _, k in desc2.rkeys}.isdisjoint(k for _, k in dst.desc.rkeys)
        await (await a.client.submit_single_write(100, imm, (src.mr, 0), (desc2, 200))).wait(WAIT)
        w = await a.client.submit_single_write(100, imm, (src.mr, 0), (dst.desc, 200))
        with pytest.raises(NotFound):
            await w.wait(WAIT)
        # Freeing the buffer revokes its regions too.
        await b.client.free_buffer(dst.buf)
        b.buffers.remove(dst.buf)
        w = await a.client.submit_single_write(100, imm, (src.mr, 0), (desc2, 0))
        with pytest.raises(NotFound):
            await w.wait(WAIT)
        # A deregistered source cannot be written from.
        other = await b.region(4096)
        await a.client.dereg_mr(src.mr)
        w = await a.client.submit_single_write(100, imm, (src.mr, 0), (other.desc, 0))
        with pytest.raises(NotFound):
            await w.wait(WAIT)
        assert await b.read(other) == bytes(4096)


@async_test(timeout=60)
async def test_synchronize_waits_for_engine_submits(tcp_cluster: Cluster) -> None:
    cl = tcp_cluster
    async with nodes(cl.a, cl.b, cl.a) as (a, b, a2):
        src = await a.region(256 * 1024, seed=49)
        dst = await b.region(256 * 1024)
        imm = fresh_imm()
        await (await a.client.submit_single_write(16, imm, (src.mr, 0), (dst.desc, 0))).wait(WAIT)
        with stopped(cl.b):
            # B cannot acknowledge while it is stopped: these cannot complete yet.
            ws = [await a.client.submit_single_write(64 * 1024, imm, (src.mr, k * 65536),
                                                     (dst.desc, k * 65536)) for k in range(4)]
            sync = asyncio.ensure_future(a.client.synchronize())
            # Another connection to the same daemon is not held up by it.
            assert await a2.client.imm_count(imm) == 0
            await asyncio.sleep(0.3)
            assert not sync.done()
            early = [(w, w.exception()) for w in ws if w.done()]
            assert not early, early
        await asyncio.wait_for(sync, WAIT)
        # When SYNCHRONIZE returns, every submit before it has completed.
        assert all(w.done() and w.exception() is None for w in ws)
        assert await b.client.imm_count(imm) == 5
        assert await b.read(dst) == bytes(src.data)
        # With nothing outstanding it returns at once.
        await asyncio.wait_for(a.client.synchronize(), WAIT)


@async_test(timeout=90)
async def test_client_vanishing_with_transfers_in_flight(cluster: Cluster) -> None:
    async with nodes(cluster.a, cluster.b) as (a, b):
        dst = await b.region(8 * MiB, seed=50)
        src = await a.region(8 * MiB, seed=51)
        imm, imm2 = fresh_imm(), fresh_imm()

        # A sender that submits a lot and closes without waiting for any of it.
        x = await Client.connect(client_url(cluster.a), timeout=WAIT)
        ws = [await x.submit_single_write(256 * 1024, imm, (src.mr, k * 256 * 1024),
                                          (dst.desc, k * 256 * 1024)) for k in range(32)]
        await x.close()
        errors = await settle(ws)
        assert all(e is None or isinstance(e, ConnectionLost) for e in errors), errors
        # And one that drops its connection without a goodbye, mid-submit.
        z = await Client.connect(client_url(cluster.a), timeout=WAIT)
        zs = [await z.submit_single_write(256 * 1024, fresh_imm(), (src.mr, 0), (dst.desc, 0))
              for _ in range(8)]
        transport = z.conn.transport
        assert transport is not None
        transport.abort()
        errors = await settle(zs)
        assert all(e is None or isinstance(e, ConnectionLost) for e in errors), errors
        with contextlib.suppress(Exception):
            await z.close()

        # A receiver that registers an expectation and receives, then goes away.
        y = await Client.connect(client_url(cluster.b), timeout=WAIT)
        ey = await y.expect_imm_count(imm2, 3, wait=False)
        y.submit_recvs(64, 2, lambda m: None)
        await y.imm_count(0)
        await y.close()
        assert ey.done() and isinstance(ey.exception(), ConnectionLost)
        await wait_connections(cluster.b, 1)

        # The first sender's writes were all read before its close, and all land.
        assert await poll(lambda: b.client.imm_count(imm), 32) == 32
        # The gone receiver's expectation is cancelled: it consumes nothing.
        ws = [await a.client.submit_single_write(4096, imm2, (src.mr, 0), (dst.desc, 0))
              for _ in range(3)]
        assert await settle(ws) == [None] * 3
        assert await b.client.imm_count(imm2) == 3
        await (await b.client.expect_imm_count(imm2, 3, wait=False)).wait(WAIT)
        # Both daemons still serve everyone else.
        assert digest(await b.read(dst)) == digest(src.data)
        await wait_connections(cluster.a, 1)


@async_test(timeout=60)
async def test_peer_plane_survives_bad_and_vanishing_peers(tcp_cluster: Cluster) -> None:
    """A fake peer speaking the daemon-to-daemon frames by hand, badly."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.b) as (a, b):
        addr_b = await b.client.main_address()
        dst = await b.region(64 * 1024, seed=52)
        rail0 = tcp_rails(addr_b)[0]
        (_, k0), (_, k1) = dst.desc.rkeys
        imm = fresh_imm()

        def probe() -> None:
            # Garbage, frames before the handshake, a HELLO with the wrong rail count:
            # each gets the link closed, nothing else.
            with RawConn(*rail0) as conn:
                conn.send_raw(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))
                assert conn.closed_by_peer()
            with RawConn(*rail0) as conn:
                conn.send(PeerCommand.WRITE, {"op": 1, "part": 0, "rkey": k0,
                                              "addrs": [dst.desc.ptr], "lens": [4]}, b"evil")
                assert conn.closed_by_peer()
            with FakePeer(addr_b, 0, SECRET, claim=(b"127.0.0.9:1",)) as one_rail:
                err = handshake_error(one_rail)
                assert isinstance(err, BadRequest) and "rail count mismatch" in str(err), err
                assert one_rail.conn.closed_by_peer()
            # A proper link: every bad write is answered with its error, the link lives on.
            with FakePeer(addr_b, 0, SECRET) as peer:
                peer.handshake()
                p = dst.desc.ptr
                for rkey, addrs, lens, payload, code in [
                    (k0 ^ 1, [p], [4], b"evil", "NOT_FOUND"),
                    (k1, [p], [4], b"evil", "NOT_FOUND"),  # rail 1's key on rail 0
                    (k0, [p + 64 * 1024 - 3], [4], b"evil", "OUT_OF_BOUNDS"),
                    (k0, [p, p + 64 * 1024], [4, 1], b"evil!", "OUT_OF_BOUNDS"),
                    (k0, [p - 4], [4], b"evil", "OUT_OF_BOUNDS"),
                ]:
                    ack = peer.write(rkey, addrs, lens, payload, imm=imm)
                    assert ack.body.get("code") == code, (ack.body, code)
                # Headers that lie, framed (the data phase's fields are fixed-width: no
                # wrong types, only wrong values): each refused, its bytes skipped.
                w = {"op": 1, "part": 0, "rkey": k0, "addrs": [p], "lens": [4], "imm": imm}
                for frame in (
                    raw_write(w, b"evil+", payload_len=5),  # payload != pages
                    raw_write({**w, "lens": [(1 << 64) - 4]}, b"evil", payload_len=4),
                    raw_write({**w, "addrs": [(1 << 64) - 2]}, b"evil"),  # past the end
                    raw_write({**w, "span": (p, 8), "addrs": [p, p + 4], "lens": [2, 2]},
                              b"evil"),  # a span with two ranges
                    raw_write({**w, "span": (p + 8, 8)}, b"evil"),  # outside its span
                    raw_write(w, b"evil", ext=b"EXTBLOCK"),  # an extension block
                ):
                    peer.conn.send_raw(frame)
                    assert peer.recv().body.get("code") == "BAD_REQUEST"
                ack = peer.write(k0, [p + 8], [4], b"good", imm=imm)
                assert ack.body.get("ok") is True, ack.body
                # A message over the limit is refused before any memory is taken for it.
                peer.send(PeerCommand.SEND, {"op": 77, "part": 0}, bytes(MAX_MESSAGE + 1))
                ack = peer.recv()
                assert ack.body.get("code") == "BAD_REQUEST", ack.body
                assert "over the limit" in ack.body["message"]
                # Then it dies in the middle of a write's payload.
                peer.conn.send_raw(data_frame(PeerCommand.WRITE, {
                    "op": 999, "part": 0, "rkey": k0, "addrs": [p + 16],
                    "lens": [1000], "imm": imm}) + b"x" * 10)

        await asyncio.to_thread(probe)
        dst.data[8:12] = b"good"
        # Only the good write counted; the cut one did not.
        assert await poll(lambda: b.client.imm_count(imm), 1) == 1
        await asyncio.sleep(0.2)
        assert await b.client.imm_count(imm) == 1
        got = await b.read(dst)
        assert got[:16] == bytes(dst.data[:16]) and got[1016:] == bytes(dst.data[1016:])
        # B still takes writes from real peers.
        src = await a.region(4096, seed=53)
        await (await a.client.submit_single_write(4096, imm, (src.mr, 0),
                                                  (dst.desc, 8192))).wait(WAIT)
        assert await b.read(dst, 8192, 4096) == bytes(src.data)


@async_test(timeout=90)
async def test_submits_beyond_the_worker_queue_wait_for_a_slot(tcp_cluster: Cluster) -> None:
    # The worker takes 4096 transfers in flight; with the peer stalled, the submits after
    # that wait (the client is slowed down), and all complete once the peer is back.
    cl = tcp_cluster
    n = 4096 + 100
    async with nodes(cl.a, cl.b) as (a, b):
        src = await a.region(4096, seed=54)
        dst = await b.region(4096)
        imm = fresh_imm()
        await (await a.client.submit_single_write(1, imm, (src.mr, 0), (dst.desc, 0))).wait(WAIT)
        with stopped(cl.b):
            ws = []
            for k in range(n):
                ws.append(await a.client.submit_single_write(1, imm, (src.mr, k % 4096),
                                                             (dst.desc, k % 4096)))
            await asyncio.sleep(0.2)
            assert not any(w.done() for w in ws)
        errors = await settle(ws, timeout=60)
        assert errors == [None] * n, {repr(e) for e in errors}
        assert await b.client.imm_count(imm) == n + 1
        assert await b.read(dst) == bytes(src.data)
