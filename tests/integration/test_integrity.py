"""Checksums end to end (docs/integrity.md): verified writes land byte-exact and count
once, a corrupting path (the chaos Domain's engine.chaos_corrupt) is caught and re-sent,
an unverified write over it can land corrupted, and a peer that lies about checksums is
refused and cut off."""

from __future__ import annotations

import asyncio
import os

from client import Pages
from tests.helpers import DaemonProcess, async_test, metric, scrape
from tests.integration.engine_cluster import (
    RAILS,
    SECRET,
    WAIT,
    Cluster,
    MiB,
    engine_env,
    fresh_imm,
    nodes,
    poll,
    secret_file,
    settle,
    start_many,
    verified,
)
from tests.integration.fake_peer import FakePeer, raw_write
from transferd.protocol.crc import crc_of
from transferd.protocol.errors import BadRequest
from transferd.protocol.peer_ext import encode_ext
from transferd.protocol.peer_inbound import MISMATCH_CUTOFF

from . import engine_cluster
from . import test_device_engine as dev

cluster = engine_cluster.cluster
clusters = engine_cluster.clusters
tcp_cluster = engine_cluster.tcp_cluster
# The stand-in device's pair of daemons (device memory reached only through staging).
pair, hold_file, fault_file = dev.pair, dev.hold_file, dev.fault_file

FAILURES = "transferd_engine_integrity_failures_total"


own_daemons = engine_cluster.own_daemons


def failures(d: DaemonProcess) -> float:
    assert d.metrics_url is not None
    return sum(v for k, v in scrape(d.metrics_url).items() if k.startswith(FAILURES))


@async_test(timeout=60)
async def test_verified_writes_land_exactly(cluster: Cluster) -> None:
    """verify=True on a single write (split in parts of 8 MiB over both rails) and a
    paged one: the bytes land exactly, each counts once, and no checksum fails on a
    clean path."""
    async with nodes(cluster.a, cluster.b) as (a, b):
        size = 20 * MiB + 4096
        src = await a.region(size, seed=91)
        dst = await b.region(size + 64 * 1024)
        imm = fresh_imm()
        before = failures(cluster.b)
        done = [await a.client.submit_single_write(size, imm, (src.mr, 0), (dst.desc, 0),
                                                   verify=True)]
        pages = [3, 0, 7, 5]
        done.append(await a.client.submit_paged_writes(
            4096, imm, (src.mr, Pages(pages, 4096, 0)),
            (dst.desc, Pages(list(range(len(pages))), 4096, size)), verify=True))
        assert await settle(done) == [None, None]
        assert await poll(lambda: b.client.imm_count(imm), 1 + len(pages)) == 1 + len(pages)
        got = await b.read(dst)
        assert got[:size] == bytes(src.data)
        for k, p in enumerate(pages):
            off = size + k * 4096
            assert got[off:off + 4096] == bytes(src.data[p * 4096:(p + 1) * 4096])
        await asyncio.sleep(0.1)
        assert await b.client.imm_count(imm) == 1 + len(pages)
        assert failures(cluster.b) == before


@async_test(timeout=60)
async def test_a_peer_lying_about_checksums_is_refused_and_cut_off(
        tcp_cluster: Cluster) -> None:
    """A raw peer: a write whose checksum is wrong is refused (nothing counts, the
    failure counter moves); one that is right lands; MISMATCH_CUTOFF wrong ones in a
    row close the link."""
    cl = tcp_cluster
    async with nodes(cl.b) as (b,):
        addr_b = await b.client.main_address()
        dst = await b.region(64 * 1024)
        (_, k0), _ = dst.desc.rkeys
        imm = fresh_imm()
        before = failures(cl.b)
        p = dst.desc.ptr
        good = b"good bytes, checked"

        def lie() -> list[str]:
            codes = []
            with FakePeer(addr_b, 0, SECRET) as peer:
                peer.handshake()
                w = {"op": 1, "part": 0, "rkey": k0, "addrs": [p], "lens": [len(good)],
                     "imm": imm}
                wrong = encode_ext(crc_of([good]) ^ 1, None)
                peer.conn.send_raw(raw_write(w, good, ext=wrong))
                ack = peer.recv()
                codes.append(ack.body.get("code"))
                assert "checksum mismatch" in ack.body["message"], ack.body
                # The right one lands (and resets the count in a row).
                peer.conn.send_raw(raw_write({**w, "op": 2}, good,
                                             ext=encode_ext(crc_of([good]), None)))
                assert peer.recv().body.get("ok") is True
                for op in range(3, 3 + MISMATCH_CUTOFF):
                    peer.conn.send_raw(raw_write({**w, "op": op}, good, ext=wrong))
                    codes.append(peer.recv().body.get("code"))
                assert peer.conn.closed_by_peer()
            return codes

        codes = await asyncio.to_thread(lie)
        assert codes == ["PEER_UNREACHABLE"] * (1 + MISMATCH_CUTOFF)
        # Only the write whose checksum held counted.
        assert await poll(lambda: b.client.imm_count(imm), 1) == 1
        await asyncio.sleep(0.1)
        assert await b.client.imm_count(imm) == 1
        assert failures(cl.b) == before + 1 + MISMATCH_CUTOFF


@async_test(timeout=90)
async def test_chaos_corrupt_caught_by_verify(own_daemons: list[DaemonProcess]) -> None:
    """Over a path that flips a byte of some pieces in flight (engine.chaos_corrupt):
    every verified write that succeeds is byte-exact and counted once, one that does
    not failed with the checksum's error (its re-send corrupted too), the failure
    counter moved; unverified writes over the same path land corrupted."""
    a_d, b_d = start_many([
        {"env": engine_env(RAILS[n], "chaos", chaos_corrupt=0.05, chaos_seed=i + 7,
                           secret_file=secret_file())}
        for i, n in enumerate("ab")])
    own_daemons += [a_d, b_d]
    n, size = 40, 64 * 1024
    async with nodes(a_d, b_d) as (a, b):
        src = await a.region(n * size, seed=92)
        dst = await b.region(n * size)
        imm = fresh_imm()
        done = [await a.client.submit_single_write(size, imm, (src.mr, i * size),
                                                   (dst.desc, i * size), verify=True)
                for i in range(n)]
        ok = await verified(done)
        assert await poll(lambda: b.client.imm_count(imm), len(ok)) == len(ok)
        got = await b.read(dst)
        for i in ok:
            assert got[i * size:(i + 1) * size] == bytes(src.data[i * size:(i + 1) * size]), i
        assert failures(b_d) > 0
        samples = scrape(a_d.metrics_url or "")
        assert metric(samples, "transferd_engine_integrity_resends_total") > 0
        # The same path without verify: some of the bytes land wrong, and count.
        plain = fresh_imm()
        done = [await a.client.submit_single_write(size, plain, (src.mr, i * size),
                                                   (dst.desc, i * size), verify=False)
                for i in range(n)]
        assert await settle(done, timeout=WAIT * 2) == [None] * n
        assert await poll(lambda: b.client.imm_count(plain), n) == n
        got = await b.read(dst)
        bad = [i for i in range(n)
               if got[i * size:(i + 1) * size] != bytes(src.data[i * size:(i + 1) * size])]
        assert bad, "nothing was corrupted: chaos_corrupt did nothing"
        # The source was never touched.
        assert await a.read(src) == bytes(src.data)


@async_test(timeout=60)
async def test_engine_verify_requires_checksums(own_daemons: list[DaemonProcess]) -> None:
    """engine.verify on the receiver: a write without a checksum is refused (nothing
    lands), one with is taken; engine.verify on the sender makes every write carry one
    unless the submit says verify=False."""
    a_d, b_d = start_many([
        {"env": engine_env(RAILS[n], verify=v, secret_file=secret_file())}
        for n, v in (("a", False), ("b", True))])
    own_daemons += [a_d, b_d]
    async with nodes(a_d, b_d) as (a, b):
        src = await a.region(8192, seed=93)
        dst = await b.region(8192)
        imm = fresh_imm()
        bare = await a.client.submit_single_write(4096, imm, (src.mr, 0), (dst.desc, 0))
        (err,) = await settle([bare])
        assert isinstance(err, BadRequest) and "without a checksum" in str(err), err
        checked = await a.client.submit_single_write(4096, imm, (src.mr, 0), (dst.desc, 0),
                                                     verify=True)
        assert await settle([checked]) == [None]
        assert await poll(lambda: b.client.imm_count(imm), 1) == 1
        assert (await b.read(dst))[:4096] == bytes(src.data[:4096])
        # B's own default: verified, unless the submit opts out (A refuses nothing).
        back = await a.region(8192)
        done = [await b.client.submit_single_write(4096, imm, (dst.mr, 0), (back.desc, 0)),
                await b.client.submit_single_write(4096, imm, (dst.mr, 0),
                                                   (back.desc, 4096), verify=False)]
        assert await settle(done) == [None, None]
        assert await poll(lambda: a.client.imm_count(imm), 2) == 2


@async_test(timeout=90)
async def test_verified_writes_over_device_staging(
        pair: tuple[DaemonProcess, DaemonProcess]) -> None:
    """Device memory (the stand-in device, reached only through staging): the sender's
    checksum is taken over its staging copy, the receiver's over the staging it landed
    in, before the device copy and the count."""
    async with dev._clients(pair) as (a, b):
        data = os.urandom(256 * 1024)
        _, smr, _ = await dev._device_region(a, len(data), data)
        dbuf, _, ddesc = await dev._device_region(b, len(data))
        imm = fresh_imm()
        done = await b.expect_imm_count(imm, 2, wait=False)
        w = [await a.submit_single_write(200 * 1024, imm, (smr, 4096), (ddesc, 8192),
                                         verify=True),
             await a.submit_paged_writes(16 * 1024, imm, (smr, Pages([1, 3], 16 * 1024, 0)),
                                         (ddesc, Pages([14, 15], 16 * 1024, 0)),
                                         verify=True)]
        assert await settle([*w, done]) == [None, None, None]
        got = bytes(await b.get_tensor(dbuf.tensor()))
        assert got[8192:8192 + 200 * 1024] == data[4096:4096 + 200 * 1024]
        assert got[14 * 16384:15 * 16384] == data[16384:2 * 16384]
        assert got[15 * 16384:16 * 16384] == data[3 * 16384:4 * 16384]
