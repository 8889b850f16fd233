"""Faults that need daemons of their own: a peer killed mid-transfer, a peer that hangs,
a peer with another number of rails."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from client import Client, MrDesc, NetAddr, Pages
from tests.helpers import (
    DaemonProcess,
    async_test,
    digest,
    metric,
    pattern,
    scrape,
    wait_until,
)
from tests.integration import engine_cluster
from tests.integration.engine_cluster import (
    RAILS,
    WAIT,
    engine_env,
    fresh_imm,
    nodes,
    settle,
    start_many,
    stopped,
    tcp_rails,
)
from transferd.protocol.errors import BadRequest, PeerUnreachable, Timeout

MiB = 1 << 20


own_daemons = engine_cluster.own_daemons


@async_test(timeout=90)
async def test_peer_killed_mid_transfer(own_daemons: list[DaemonProcess]) -> None:
    a_d, b_d, c_d = start_many([{"env": engine_env(RAILS[n])} for n in "abc"])
    own_daemons += [a_d, b_d, c_d]
    big = 48 * MiB
    async with nodes(a_d, a_d, b_d, c_d) as (a, a2, b, c):
        src = await a.region(big, seed=60)
        rb = await b.region(big)
        rc = await c.region(8 * MiB)
        imm = fresh_imm()
        # Links up, both peers answering.
        ws = [await a.client.submit_single_write(4096, imm, (src.mr, 0), (rb.desc, 0)),
              await a2.client.submit_single_write(4096, imm, (src.mr, 0), (rc.desc, 0))]
        assert await settle(ws) == [None, None]

        with stopped(b_d):
            # B takes no more bytes: this write is stuck in the sockets, mid-transfer,
            # and so are the small ones behind it.
            w_big = await a.client.submit_single_write(big, imm, (src.mr, 0), (rb.desc, 0))
            w_small = [await a.client.submit_paged_writes(
                4096, imm, (src.mr, Pages([k], 4096)), (rb.desc, Pages([k + 1], 4096)))
                for k in range(8)]
            # Meanwhile writes to a live peer go on, on the same worker and rails.
            ec = await c.client.expect_imm_count(imm, 9, wait=False)
            ws = [await a2.client.submit_single_write(MiB, imm, (src.mr, k * MiB),
                                                      (rc.desc, k * MiB)) for k in range(8)]
            assert await settle(ws) == [None] * 8
            await ec.wait(WAIT)
            assert digest(await c.read(rc)) == digest(src.data[: 8 * MiB])
            assert not w_big.done()  # B is stopped: it cannot have acknowledged
            b_d.kill()  # kill -9, while stopped and mid-transfer
            killed = time.monotonic()

        # The initiator learns of it: no hang, the typed error, well within its deadline
        # (the peer timeout is 30 s: the broken links say so at once).
        errors = await settle([w_big, *w_small])
        took = time.monotonic() - killed
        assert all(isinstance(e, PeerUnreachable) for e in errors), errors
        assert took < 5.0, took
        # Writes to the dead peer fail at once (nobody listens on its rails any more).
        w = await a.client.submit_single_write(4096, imm, (src.mr, 0), (rb.desc, 0))
        with pytest.raises(PeerUnreachable):
            await w.wait(WAIT)
        got: list[bytes] = []
        c.client.submit_recvs(64, 1, got.append)
        await c.client.imm_count(0)  # the receive is posted before the send
        w = await a.client.submit_send(await c.client.main_address(), b"still here")
        await w.wait(WAIT)  # acknowledged once C's daemon handed it to its client
        assert await asyncio.to_thread(wait_until, lambda: got == [b"still here"], WAIT), got
        # The live peer keeps working, from both clients of A.
        ws = [await a.client.submit_single_write(MiB, imm, (src.mr, 0), (rc.desc, 0)),
              await a2.client.submit_single_write(2 * MiB, imm, (src.mr, 0), (rc.desc, 0))]
        assert await settle(ws) == [None, None]
        assert await c.client.imm_count(imm) == 2
        assert a_d.alive() and c_d.alive()


@async_test(timeout=60)
async def test_peer_that_hangs_times_out(own_daemons: list[DaemonProcess]) -> None:
    a_d, b_d = start_many([{"env": engine_env(RAILS["a"], peer_timeout_s=1)},
                           {"env": engine_env(RAILS["b"])}])
    own_daemons += [a_d, b_d]
    async with nodes(a_d, b_d) as (a, b):
        src = await a.region(4 * MiB, seed=61)
        dst = await b.region(4 * MiB)
        imm = fresh_imm()
        await (await a.client.submit_single_write(100, imm, (src.mr, 0), (dst.desc, 0))).wait(WAIT)
        with stopped(b_d):
            ws = [await a.client.submit_single_write(4096, imm, (src.mr, 0), (dst.desc, 0)),
                  await a.client.submit_single_write(4 * MiB, imm, (src.mr, 0), (dst.desc, 0))]
            errors = await settle(ws)
        assert all(isinstance(e, Timeout) for e in errors), errors
        # Once it answers again, it is usable again.  The daemon's 1 s peer
        # timeout covers the reconnect and the handshake too, which a loaded
        # machine can take longer than: a few tries (bounded), the last must land.
        for attempt in range(5):
            w = await a.client.submit_single_write(4 * MiB, None, (src.mr, 0), (dst.desc, 0))
            try:
                await w.wait(WAIT)
                break
            except Timeout:
                if attempt == 4:
                    raise
        assert digest(await b.read(dst)) == digest(src.data)


@async_test(timeout=60)
async def test_rail_count_mismatch(own_daemons: list[DaemonProcess], tmp_path: Path) -> None:
    # D has one rail (from a config file given with -c), A two.
    conf = tmp_path / "one-rail.toml"
    conf.write_text('[engine]\nhost_rails = ["127.0.0.8"]\ndomain = "tcp"\n')
    a_d, d_d = start_many([{"env": engine_env(RAILS["a"])}, {"args": ["-c", str(conf)]}])
    own_daemons += [a_d, d_d]
    async with nodes(a_d, d_d) as (a, d):
        addr_a, addr_d = await a.client.main_address(), await d.client.main_address()
        assert [h for h, _ in tcp_rails(addr_d)] == ["127.0.0.8"]
        ra = await a.region(8192, seed=62)
        rd = await d.region(8192, seed=63)
        assert len(rd.desc.rkeys) == 1
        # Refused at submit, in both directions, with a message that names both counts.
        checks = [
            await a.client.submit_single_write(100, None, (ra.mr, 0), (rd.desc, 0)),
            await a.client.submit_paged_writes(64, None, (ra.mr, Pages([0], 64)),
                                               (rd.desc, Pages([1], 64))),
            await a.client.submit_barrier(None, 1, [rd.desc]),
            await a.client.submit_send(addr_d, b"hi"),
            await d.client.submit_single_write(100, None, (rd.mr, 0), (ra.desc, 0)),
        ]
        for e in await settle(checks):
            assert isinstance(e, BadRequest), e
            assert "rail count mismatch" in str(e) and "1" in str(e) and "2" in str(e), e
        with pytest.raises(BadRequest, match="rail count mismatch"):
            await a.client.add_peer_group([addr_d])
        with pytest.raises(BadRequest, match="rail count mismatch"):
            await d.client.add_peer_group([addr_a])
        # A NetAddr that claims two rails for D gets past the submit check and is refused
        # when the link is set up.
        liar = NetAddr(addr_d.node, addr_d.group, (addr_d.rails[0], addr_d.rails[0]))
        (_, rkey), = rd.desc.rkeys
        desc = MrDesc(rd.desc.ptr, [(liar.rail(0), rkey), (liar.rail(1), rkey)], rd.desc.size)
        ws = [await a.client.submit_single_write(100, None, (ra.mr, 0), (desc, 0)),
              await a.client.submit_send(liar, b"hi")]
        for e in await settle(ws):
            assert isinstance(e, BadRequest) and "rail count mismatch" in str(e), e
        assert await d.read(rd) == bytes(rd.data)
        # Both daemons are fine and serve matching peers.
        src2 = await d.region(100, seed=64)
        dst2 = await d.region(100)
        w = await d.client.submit_single_write(100, None, (src2.mr, 0), (dst2.desc, 0))
        await w.wait(WAIT)
        assert await d.read(dst2) == bytes(src2.data)
    # A peer that speaks a mismatched HELLO does not take the daemon down.
    assert a_d.alive() and d_d.alive()


@async_test(timeout=90)
async def test_initiator_killed_mid_write_is_never_counted(
    own_daemons: list[DaemonProcess],
) -> None:
    """A's 64 MiB write (two parts) sits half-sent in the sockets of a stopped B when A is
    killed; B, resumed, lands what reached it and then sees the links close: the write
    never counts, and B serves the next writer with the same immediate exactly once."""
    a_d, b_d, c_d = start_many([{"env": engine_env(RAILS[n])} for n in "abc"])
    own_daemons += [a_d, b_d, c_d]
    big = 64 * MiB
    async with nodes(b_d, c_d) as (b, c):
        dst = await b.region(big)
        src_c = await c.region(4096, seed=66)
        imm = fresh_imm()
        a = await Client.connect(a_d.url, timeout=WAIT)
        buf = await a.alloc_buffer(big)
        await a.set_tensor(buf.tensor(0, 4096), pattern(4096, 65))
        mr, _ = await a.reg_mr(buf)
        await (await a.submit_single_write(4096, None, (mr, 0), (dst.desc, 0))).wait(WAIT)
        with stopped(b_d):
            w = await a.submit_single_write(big, imm, (mr, 0), (dst.desc, 0))
            await asyncio.sleep(0.5)  # the sockets fill up, the rest waits in A
            assert not w.done()
            a_d.kill()
        await a.close()
        # B reads the bytes that reached it, then the links close under the parts.
        for _ in range(20):  # 2 s
            await asyncio.sleep(0.1)
            assert await b.client.imm_count(imm) == 0
        partial = metric(scrape(b_d.metrics_url or ""), "transferd_engine_partial_writes")
        print(f"B holds {partial:g} partial write(s) of the dead initiator")
        assert partial <= 1
        w = await c.client.submit_single_write(4096, imm, (src_c.mr, 0), (dst.desc, 0))
        await w.wait(WAIT)
        assert await b.client.imm_count(imm) == 1
        assert digest(await b.read(dst, 0, 4096)) == digest(bytes(src_c.data))
        assert b_d.alive() and c_d.alive()


@async_test(timeout=90)
async def test_stopped_peer_resumed_links_recover(own_daemons: list[DaemonProcess]) -> None:
    """B stopped for 0.8 s (under A's rail and peer timeouts) with a write, pages and a
    message under way: once resumed, every one completes on the links it had, each
    counted once, bytes checked.  Stopped for longer than engine.rail_timeout_s with
    bytes stuck, the links are given up; later writes dial again and succeed."""
    a_d, b_d = start_many([{"env": engine_env(RAILS["a"], peer_timeout_s=20,
                                              rail_timeout_s=2.0, handshake_timeout_s=1)},
                           {"env": engine_env(RAILS["b"])}])
    own_daemons += [a_d, b_d]
    async with nodes(a_d, b_d) as (a, b):
        src = await a.region(64 * MiB, seed=67)
        dst = await b.region(64 * MiB)
        imm = fresh_imm()
        # Both rails' links up (a write of 1 MiB and more is split over the rails).
        await (await a.client.submit_single_write(2 * MiB, None, (src.mr, 0),
                                                  (dst.desc, 0))).wait(WAIT)
        got: list[bytes] = []
        b.client.submit_recvs(64, 1, got.append)
        addr_b = await b.client.main_address()
        with stopped(b_d):
            ws = [await a.client.submit_single_write(2 * MiB, imm, (src.mr, 0), (dst.desc, 0)),
                  await a.client.submit_paged_writes(
                      4096, imm, (src.mr, Pages(list(range(512, 544)), 4096)),
                      (dst.desc, Pages(list(range(512, 544)), 4096))),
                  await a.client.submit_send(addr_b, b"after the stop")]
            await asyncio.sleep(0.8)
            assert not any(w.done() for w in ws)
        assert await settle(ws) == [None] * 3
        assert await b.client.imm_count(imm) == 1 + 32
        assert got == [b"after the stop"]
        assert digest(await b.read(dst, 0, 2 * MiB)) == digest(bytes(src.data[:2 * MiB]))
        # Stopped with 64 MiB stuck (more than the sockets hold) for longer than the rail
        # timeout: both rails are given up (a redial's handshake too), the write fails in
        # a few seconds, not after the 20 s peer timeout.
        with stopped(b_d):
            t0 = time.monotonic()
            w = await a.client.submit_single_write(64 * MiB, None, (src.mr, 0), (dst.desc, 0))
            (err,) = await settle([w], 15)
            took = time.monotonic() - t0
            print(f"given up after {took:.2f} s: {err}")
        assert isinstance(err, PeerUnreachable), err
        assert took < 10, took
        t0 = time.monotonic()
        failed = 0
        for _ in range(10):  # the links come back after their back-off
            w = await a.client.submit_single_write(64 * MiB, None, (src.mr, 0), (dst.desc, 0))
            (err,) = await settle([w])
            if err is None:
                break
            assert isinstance(err, PeerUnreachable), err
            failed += 1
            await asyncio.sleep(0.3)
        print(f"recovered after {failed} failed tries, {time.monotonic() - t0:.2f} s")
        assert err is None, err
        assert digest(await b.read(dst)) == digest(bytes(src.data))


@async_test(timeout=60)
async def test_a_rail_that_cannot_be_dialled_fails_over(own_daemons: list[DaemonProcess]) -> None:
    """Loopback failover (no namespaces needed): B's region as seen through a descriptor
    whose rail 1 is a port nobody listens on.  Every part planned on rail 1 is refused
    there and re-sent on rail 0 with rail 0's rkey: the writes complete, each counted
    once, bytes checked; later parts skip the rail while it is down."""
    a_d, b_d = start_many([{"env": engine_env(RAILS["a"])}, {"env": engine_env(RAILS["b"])}])
    own_daemons += [a_d, b_d]
    async with nodes(a_d, b_d) as (a, b):
        size = 4 * MiB
        src = await a.region(size, seed=68)
        dst = await b.region(size)
        dead = socket.socket()
        dead.bind((RAILS["b"][1], 0))  # bound, never listening: connections are refused
        try:
            port = dead.getsockname()[1]
            (addr0, key0), (addr1, key1) = dst.desc.rkeys
            cut = NetAddr(addr1.node, addr1.group, (f"{RAILS['b'][1]}:{port}".encode(),))
            desc = MrDesc(dst.desc.ptr, [(addr0, key0), (cut, key1)], dst.desc.size)
            imm = fresh_imm()
            ws = [await a.client.submit_single_write(size, imm, (src.mr, 0), (desc, 0))]
            ws += [await a.client.submit_paged_writes(
                4096, imm, (src.mr, Pages([k], 4096)), (desc, Pages([k], 4096)))
                for k in range(8)]  # ops alternate their first rail: half start on rail 1
            assert await settle(ws) == [None] * 9
            assert await b.client.imm_count(imm) == 1 + 8
            assert digest(await b.read(dst)) == digest(bytes(src.data))
            failovers = metric(scrape(a_d.metrics_url or ""), "transferd_engine_failovers_total")
            print(f"{failovers:g} part(s) re-sent on rail 0")
            assert 1 <= failovers <= 9
        finally:
            dead.close()
