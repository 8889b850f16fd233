"""Write ids against real daemons: a write that timed out (its receiver SIGSTOPped) and
is retried with the same id after SIGCONT lands and counts exactly once, whatever the
first attempt did meanwhile; the same id with other contents is refused."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest

from client import Pages
from tests.helpers import DaemonProcess, async_test, digest, metric, scrape
from tests.integration import engine_cluster
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
    settle,
    start_many,
    stopped,
)
from tests.integration.fake_peer import FakePeer, raw_write
from transferd.protocol.errors import BadRequest, Timeout
from transferd.protocol.peer import PeerCommand

clusters = engine_cluster.clusters
tcp_cluster = engine_cluster.tcp_cluster

PAGE = 4096


@pytest.fixture
def own() -> Iterator[list[DaemonProcess]]:
    started: list[DaemonProcess] = []
    yield started
    for d in started:
        d.stop()
    for d in started:
        assert "Traceback" not in d.stderr, d.output()


async def _retry(submit, attempts: int = 8) -> None:  # type: ignore[no-untyped-def]
    """Submit until it completes ok; TIMEOUT (outcome unknown) is retried, bounded."""
    for attempt in range(attempts):
        try:
            await (await submit()).wait(WAIT)
            return
        except Timeout:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.1)


async def _steady(fn, settle_s: float = 0.5, timeout: float = WAIT):  # type: ignore[no-untyped-def]
    """``await fn()`` once it has stopped changing for ``settle_s`` (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last, since = await fn(), loop.time()
    while loop.time() < deadline:
        await asyncio.sleep(0.1)
        now = await fn()
        if now != last:
            last, since = now, loop.time()
        elif loop.time() - since >= settle_s:
            break
    return last


@pytest.mark.parametrize("domain", ["tcp", "chaos"])
@async_test(timeout=120)
async def test_a_retry_after_timeout_counts_once(own: list[DaemonProcess], domain: str) -> None:
    """Over tcp, and over chaos (every frame in pieces, out of order: a retry's pieces
    meet the first attempt's)."""
    a_d, b_d = start_many([{"env": engine_env(RAILS["a"], domain, peer_timeout_s=1)},
                           {"env": engine_env(RAILS["b"], domain)}])
    own += [a_d, b_d]
    wid0 = random.Random().randrange(1 << 40, 1 << 62)
    async with nodes(a_d, b_d) as (a, b):
        src = await a.region(8 * MiB, seed=71)
        dst = await b.region(8 * MiB)
        singles, paged, split, control = fresh_imm(), fresh_imm(), fresh_imm(), fresh_imm()
        await (await a.client.submit_single_write(100, None, (src.mr, 0), (dst.desc, 0))).wait(WAIT)

        def single(i: int):  # type: ignore[no-untyped-def]
            off = i * 64 * 1024  # small: the whole frame waits in the stopped peer's socket
            return a.client.submit_single_write(64 * 1024, singles, (src.mr, off),
                                                (dst.desc, off), wid=wid0 + i)

        def pages():  # type: ignore[no-untyped-def]
            idx = list(range(16))
            return a.client.submit_paged_writes(
                PAGE, paged, (src.mr, Pages(idx, PAGE, MiB)), (dst.desc, Pages(idx, PAGE, MiB)),
                wid=wid0 + 100)

        def big():  # type: ignore[no-untyped-def]
            # Split over both rails; most of it cannot wait in socket buffers.
            return a.client.submit_single_write(4 * MiB, split, (src.mr, 2 * MiB),
                                                (dst.desc, 2 * MiB), wid=wid0 + 200)

        def plain():  # type: ignore[no-untyped-def]
            off = 7 * MiB  # no id: the control, which may count twice
            return a.client.submit_single_write(64 * 1024, control, (src.mr, off),
                                                (dst.desc, off))

        with stopped(b_d):
            ws = [await single(i) for i in range(4)] + [await pages(), await big(), await plain()]
            errors = await settle(ws)
        assert all(isinstance(e, Timeout) for e in errors), errors
        # After SIGCONT: retried with the same ids until each completes (the first
        # attempts may land meanwhile, or be still landing: TIMEOUT again, retried).
        for i in range(4):
            await _retry(lambda i=i: single(i))
        await _retry(pages)
        await _retry(big)
        await _retry(plain)
        # Whatever the first attempts still had in flight has landed by now.
        assert await _steady(lambda: b.client.imm_count(singles)) == 4
        assert await b.client.imm_count(paged) == 16
        assert await b.client.imm_count(split) == 1
        # The control (no id) counted at least once: twice if its first attempt landed.
        ctl_count = await b.client.imm_count(control)
        assert ctl_count >= 1
        want = bytearray(dst.data)
        want[0:100] = src.data[0:100]
        want[0:4 * 64 * 1024] = src.data[0:4 * 64 * 1024]
        want[MiB:MiB + 16 * PAGE] = src.data[MiB:MiB + 16 * PAGE]  # the 16 pages, in a row
        want[2 * MiB:6 * MiB] = src.data[2 * MiB:6 * MiB]
        want[7 * MiB:7 * MiB + 64 * 1024] = src.data[7 * MiB:7 * MiB + 64 * 1024]
        assert digest(await b.read(dst)) == digest(want)
        m = scrape(b_d.metrics_url or "")
        dups = metric(m, "transferd_engine_write_id_duplicates_total")
        # The small first attempts waited whole in the stopped peer's socket and landed
        # after SIGCONT, so their retries were acknowledged without counting again.
        assert dups >= 1 or ctl_count == 1, (dups, ctl_count)
        print(f"write-id retries applied before: {dups:.0f}; the control counted {ctl_count}")

        # Applied ids are remembered: the same write again is acknowledged, not counted.
        await (await single(0)).wait(WAIT)
        assert await b.client.imm_count(singles) == 4
        # The same id and part with other contents is refused (an id names one write).
        # (Refused by A now, before anything is sent: an id is its connection's, #16.6.)
        with pytest.raises(BadRequest, match="names one write"):
            w = await a.client.submit_single_write(64 * 1024, singles, (src.mr, 0),
                                                   (dst.desc, 3 * MiB), wid=wid0)
            await w.wait(WAIT)
        assert await b.client.imm_count(singles) == 4


@async_test(timeout=60)
async def test_a_peer_that_lies_about_write_ids(tcp_cluster: Cluster) -> None:
    """A peer (real handshake, the cluster secret) replays, reuses and cuts writes with
    ids: each id counts once, a reused id with other ranges is refused, a bad id is
    refused, and a part cut off mid-payload leaves nothing, so its retry lands."""
    async with nodes(tcp_cluster.b) as (b,):
        addr = await b.client.main_address()
        dst = await b.region(64 * 1024)
        imm = fresh_imm()
        k0, p = dst.desc.rkeys[0][1], dst.desc.ptr
        wid = random.Random().randrange(1 << 62)

        def attack() -> None:
            with FakePeer(addr, 0, SECRET) as peer:
                peer.handshake()
                for op in (1, 2, 3):  # the same write three times (three "retries")
                    ack = peer.write(k0, [p], [4], b"abcd", op=op, imm=imm, wid=wid)
                    assert ack.body.get("ok") is True, ack.body
                ack = peer.write(k0, [p + 8], [4], b"efgh", op=4, imm=imm, wid=wid)
                assert ack.body.get("code") == "BAD_REQUEST", ack.body
                assert "other contents" in ack.body["message"]
                # An id's field is 64 bits on the wire (no wrong types); a frame with one
                # that is refused (here for an extension block) claims nothing: the same
                # id's real write lands after it, once.
                frame = raw_write({"op": 5, "part": 0, "rkey": k0, "addrs": [p + 16],
                                   "lens": [4], "imm": imm, "wid": wid + 7}, b"ijkl",
                                  ext=b"EXTBLOCK")
                peer.conn.send_raw(frame)
                assert peer.recv().body.get("code") == "BAD_REQUEST"
                ack = peer.write(k0, [p + 16], [4], b"ijkl", op=5, imm=imm, wid=wid + 7)
                assert ack.body.get("ok") is True, ack.body
                # Half a payload, then the link goes: that part did not land.
                peer.send(PeerCommand.WRITE, {"op": 6, "part": 0, "rkey": k0,
                                              "addrs": [p + 4096], "lens": [4096],
                                              "imm": imm, "wid": wid + 1}, b"h" * 2048)
                claim = peer.me.addrs
                node = peer.me.node
            with FakePeer(addr, 0, SECRET, node=node, claim=claim) as again:
                again.handshake()
                for op in range(7, 47):  # TIMEOUT while B has not yet seen the cut: retry
                    ack = again.write(k0, [p + 4096], [4096], b"r" * 4096, op=op, imm=imm,
                                      wid=wid + 1)
                    if ack.body.get("code") != "TIMEOUT":
                        break
                    time.sleep(0.05)
                assert ack.body.get("ok") is True, ack.body
                ack = again.write(k0, [p + 4096], [4096], b"r" * 4096, op=50, imm=imm,
                                  wid=wid + 1)
                assert ack.body.get("ok") is True, ack.body

        await asyncio.to_thread(attack)
        assert await poll(lambda: b.client.imm_count(imm), 3) == 3
        await asyncio.sleep(0.1)
        assert await b.client.imm_count(imm) == 3
        got = await b.read(dst, 0, 8192)
        assert got[:4] == b"abcd" and got[4:16] == bytes(12) and got[16:20] == b"ijkl"
        assert got[20:4096] == bytes(4076)
        assert got[4096:] == b"r" * 4096


@async_test(timeout=60)
async def test_a_write_id_is_its_own_connections(tcp_cluster: Cluster) -> None:
    """#16.6: another client of the same daemon used my write id and my destination range
    first; my write completed OK and was never placed.  An id's scope is the connection
    that submitted it: mine lands (its bytes, its count), the other's retry is still its
    own (acknowledged, not counted again), and a retry that names another write than its
    id first did is refused, never taken for the first."""
    cl = tcp_cluster
    async with nodes(cl.a, cl.a, cl.b) as (other, me, b):
        dst = await b.region(64 * 1024)
        imm = fresh_imm()
        theirs, mine = await other.region(4096, seed=81), await me.region(4096, seed=82)
        wid = random.Random().randrange(1 << 62)
        await (await other.client.submit_single_write(4096, imm, (theirs.mr, 0),
                                                      (dst.desc, 0), wid=wid)).wait(WAIT)
        await (await me.client.submit_single_write(4096, imm, (mine.mr, 0), (dst.desc, 0),
                                                   wid=wid)).wait(WAIT)
        assert await b.read(dst, 0, 4096) == bytes(mine.data)  # placed
        assert await b.client.imm_count(imm) == 2  # and counted
        # The other's retry of its own write: acknowledged, neither placed nor counted.
        await (await other.client.submit_single_write(4096, imm, (theirs.mr, 0),
                                                      (dst.desc, 0), wid=wid)).wait(WAIT)
        assert await b.read(dst, 0, 4096) == bytes(mine.data)
        assert await b.client.imm_count(imm) == 2
        # My id once more, naming another range (or another source): refused at once.
        for src, off in ((mine, 8192), (theirs, 0)):
            with pytest.raises(BadRequest, match="named another write"):
                w = await me.client.submit_single_write(4096, imm, (src.mr, 0),
                                                        (dst.desc, off), wid=wid)
                await w.wait(WAIT)
        assert await b.read(dst, 8192, 4096) == bytes(4096)
        assert await b.client.imm_count(imm) == 2
