"""READs against peers that fail: killed mid-read, SIGSTOPped past the read's deadline,
a read cancelled while its peer is stopped (what arrives after is dropped, never
written), a rail that cannot be dialled (re-read on the other), and a region
deregistered while a read of it is admitted (DEREG_MR waits for it)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator

import pytest

from client import MrDesc, NetAddr
from tests.helpers import DaemonProcess, async_test, digest, metric, scrape
from tests.integration.engine_cluster import (
    RAILS,
    WAIT,
    engine_env,
    nodes,
    settle,
    start_many,
    stopped,
)
from tests.integration.test_engine_reads import region
from transferd.protocol.errors import Cancelled, PeerUnreachable, Timeout

MiB = 1 << 20


@pytest.fixture
def own_daemons(request: pytest.FixtureRequest) -> Iterator[list[DaemonProcess]]:
    started: list[DaemonProcess] = []
    yield started
    failed = any(getattr(getattr(request.node, f"rep_{w}", None), "failed", False)
                 for w in ("setup", "call"))
    for d in started:
        d.stop()
        if failed:
            print(d.output())
    for d in started:
        assert "Traceback" not in d.stderr, d.output()


@async_test(timeout=90)
async def test_a_peer_killed_mid_read_fails_it_at_once(own_daemons: list[DaemonProcess]
                                                        ) -> None:
    a_d, b_d = start_many([{"env": engine_env(RAILS[n])} for n in "ab"])
    own_daemons += [a_d, b_d]
    async with nodes(a_d, b_d) as (a, b):
        src = await region(b, 32 * MiB, seed=11, access="r")
        dst = await region(a, 32 * MiB)
        await (await a.client.submit_single_read(4096, (dst.mr, 0), (src.desc, 0))).wait(WAIT)
        with stopped(b_d):
            r = await a.client.submit_single_read(32 * MiB, (dst.mr, 0), (src.desc, 0))
            await asyncio.sleep(0.2)
            assert not r.done()
            b_d.kill()
            killed = time.monotonic()
        errors = await settle([r])
        assert isinstance(errors[0], PeerUnreachable), errors
        assert time.monotonic() - killed < 5.0
        assert a_d.alive()


@async_test(timeout=90)
async def test_a_stopped_peer_meets_the_deadline_and_a_cancelled_read_writes_nothing_late(
    own_daemons: list[DaemonProcess]
) -> None:
    a_d, b_d = start_many([{"env": engine_env(RAILS[n])} for n in "ab"])
    own_daemons += [a_d, b_d]
    async with nodes(a_d, b_d) as (a, b):
        src = await region(b, 8 * MiB, seed=12, access="r")
        dst = await region(a, 16 * MiB, seed=13)
        await (await a.client.submit_single_read(4096, (dst.mr, 0), (src.desc, 0))).wait(WAIT)
        dst.data[:4096] = src.data[:4096]
        with stopped(b_d):
            t0 = time.monotonic()
            late = await a.client.submit_single_read(8 * MiB, (dst.mr, 0), (src.desc, 0),
                                                     timeout=1.0)
            with pytest.raises(Timeout):
                await late.wait(WAIT)
            assert 0.9 < time.monotonic() - t0 < 5.0  # its deadline, not the peer timeout
            gone = await a.client.submit_single_read(8 * MiB, (dst.mr, 8 * MiB),
                                                     (src.desc, 0))
            await asyncio.sleep(0.1)
            assert await gone.cancel() is True
            with pytest.raises(Cancelled):
                await gone.wait(WAIT)
        # B answers both now; A drops those bytes: its region is as before the two reads.
        r = await a.client.submit_single_read(4096, (dst.mr, 4096), (src.desc, 4096))
        await r.wait(WAIT)
        dst.data[4096:8192] = src.data[4096:8192]
        await asyncio.sleep(0.5)
        assert digest(await a.read(dst)) == digest(bytes(dst.data))


@async_test(timeout=90)
async def test_a_rail_that_cannot_be_dialled_is_read_on_the_other(
    own_daemons: list[DaemonProcess]
) -> None:
    a_d, b_d = start_many([{"env": engine_env(RAILS[n])} for n in "ab"])
    own_daemons += [a_d, b_d]
    async with nodes(a_d, b_d) as (a, b):
        src = await region(b, 4 * MiB, seed=14, access="r")
        dst = await region(a, 4 * MiB)
        dead = socket.socket()
        dead.bind((RAILS["b"][1], 0))  # bound, never listening: connections are refused
        try:
            (addr0, key0), (addr1, key1) = src.desc.rkeys
            cut = NetAddr(addr1.node, addr1.group,
                          (f"{RAILS['b'][1]}:{dead.getsockname()[1]}".encode(),))
            desc = MrDesc(src.desc.ptr, [(addr0, key0), (cut, key1)], src.desc.size)
            rs = [await a.client.submit_single_read(4 * MiB, (dst.mr, 0), (desc, 0))]
            rs += [await a.client.submit_single_read(4096, (dst.mr, k * 4096),
                                                     (desc, k * 4096)) for k in range(8)]
            assert await settle(rs) == [None] * 9
            assert digest(await a.read(dst)) == digest(bytes(src.data))
            failovers = metric(scrape(a_d.metrics_url or ""), "transferd_engine_failovers_total")
            assert 1 <= failovers <= 9
        finally:
            dead.close()


@async_test(timeout=90)
async def test_dereg_waits_for_an_admitted_read(own_daemons: list[DaemonProcess]) -> None:
    a_d, b_d = start_many([{"env": engine_env(RAILS[n])} for n in "ab"])
    own_daemons += [a_d, b_d]
    async with nodes(a_d, b_d) as (a, b):
        size = 64 * MiB
        src = await region(b, size, seed=15, access="r")
        dst = await region(a, size)
        # Both rails' links up (a read of 1 MiB and more is split over them).
        await (await a.client.submit_single_read(MiB, (dst.mr, 0), (src.desc, 0))).wait(WAIT)
        assert a_d.proc is not None
        with stopped(b_d):
            r = await a.client.submit_single_read(size, (dst.mr, 0), (src.desc, 0))
            await asyncio.sleep(0.2)  # the READs wait in B's sockets ...
            os.kill(a_d.proc.pid, signal.SIGSTOP)  # ... and A will not take the answer
        try:
            await asyncio.sleep(0.3)  # B admitted the reads; their bytes fill the sockets
            dereg = asyncio.ensure_future(b.client.dereg_mr(src.mr))
            await asyncio.sleep(0.5)
            assert not dereg.done()  # it waits for the reads admitted before it
        finally:
            os.kill(a_d.proc.pid, signal.SIGCONT)
        await asyncio.wait_for(dereg, WAIT)
        await r.wait(WAIT)
        # Admitted before the revocation: it finished, whole.
        assert digest(await a.read(dst)) == digest(bytes(src.data))
        # Revoked now: the next read of it is NOT_FOUND.
        r = await a.client.submit_single_read(4096, (dst.mr, 0), (src.desc, 0))
        with pytest.raises(Exception, match="rkey"):
            await r.wait(WAIT)
