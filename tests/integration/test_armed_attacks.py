"""ARM_PAGED_WRITES attacked: an armed write that fired while its connection's share of
the engine (engine.max_inflight_per_client) was full, the peer stopped (SIGSTOP), the
client cancelling it then; raw frames naming the same seq twice.  Bytes and immediate
counts are checked at the destination after the peer resumes: what was cancelled before
it started never lands."""

from __future__ import annotations

import asyncio
import random

import pytest

from client import Pages
from tests.helpers import async_test
from tests.integration import engine_cluster
from tests.integration.engine_cluster import (
    RAILS,
    WAIT,
    engine_env,
    fresh_imm,
    nodes,
    start_many,
    stopped,
)
from transferd.protocol.errors import Cancelled, NotFound, Timeout

own_daemons = engine_cluster.own_daemons
tcp_cluster = engine_cluster.tcp_cluster
clusters = engine_cluster.clusters
PAGE = 4096


@async_test(timeout=90)
async def test_a_fired_arm_waiting_for_room_is_cancelled_and_never_lands(
        own_daemons: list[engine_cluster.DaemonProcess]) -> None:
    own_daemons.extend(start_many([{"env": engine_env(RAILS["a"], MAX_INFLIGHT_PER_CLIENT=1)},
                                   {"env": engine_env(RAILS["b"])}]))
    async with nodes(*own_daemons) as (a, b):
        src = await a.region(4 * PAGE, seed=1)
        dst = await b.region(4 * PAGE)
        w = await a.client.alloc_uvm_watcher(lambda old, new: None)
        warm = await a.client.submit_single_write(16, None, (src.mr, 0), (dst.desc, 0))
        await warm.wait(WAIT)  # the link is up before B stops
        imm1, imm2 = fresh_imm(), fresh_imm()
        with stopped(own_daemons[1]):
            c1 = await a.client.arm_paged_writes(
                w, 1, PAGE, imm1, (src.mr, Pages([1], PAGE)), (dst.desc, Pages([1], PAGE)),
                timeout=0.5)
            c2 = await a.client.arm_paged_writes(
                w, 1, PAGE, imm2, (src.mr, Pages([2], PAGE)), (dst.desc, Pages([2], PAGE)),
                timeout=0.5)
            w.set(1)  # both fire: c1 takes the connection's one slot, c2 waits for room
            await asyncio.sleep(0.2)
            assert not c2.done()
            assert await c2.cancel() is True  # not started: CANCEL still reaches it
            with pytest.raises(Cancelled):
                await c2.wait(WAIT)
            with pytest.raises(Timeout):  # sent to the stopped peer: outcome unknown
                await c1.wait(WAIT)
            await asyncio.sleep(0.6)  # past c1's end: c2 would have started by now
        # B resumed.  c1's outcome was unknown: it lands late if its frame was in the
        # kernel's hands, never if it still waited on the link (an ended transfer's
        # parts are dropped unsent); c2 never lands.  A write after it, on every rail,
        # lands: B is reading again, so c2's absence is not B being behind.
        imm3 = fresh_imm()
        after = await a.client.submit_paged_writes(
            PAGE, imm3, (src.mr, Pages([0, 3], PAGE)), (dst.desc, Pages([0, 3], PAGE)))
        await after.wait(WAIT)
        await asyncio.wait_for(b.client.expect_imm_count(imm3, 2), WAIT)
        landed = await b.client.imm_count(imm1)
        assert landed in (0, 1)
        assert await b.client.imm_count(imm2) == 0
        got = await b.read(dst)
        assert got[2 * PAGE : 3 * PAGE] == bytes(PAGE)
        assert got[PAGE : 2 * PAGE] == (bytes(src.data[PAGE : 2 * PAGE]) if landed
                                        else bytes(PAGE))
        assert got[3 * PAGE :] == bytes(src.data[3 * PAGE :])


@async_test(timeout=90)
async def test_an_arm_made_as_its_watcher_ends_is_dropped_all_the_same(
        own_daemons: list[engine_cluster.DaemonProcess]) -> None:
    """The watcher thread's sweep ends a freed buffer's watcher (within 0.5 s) while an
    arm on it is being checked (a long page list: tens of ms); whichever comes first,
    the arm ends, NOT_FOUND: refused, or dropped naming the watcher.  Before, a sweep
    that came between the arm's watcher look-up and its entry in the table told nobody
    (no arm there yet), and the arm stayed, never to fire or end.  A race: each round
    hits it with a fair chance, all of them together nearly always (on the old code)."""
    n = 200_000  # a long page list: the arm's checks take a while
    # (over the default engine.max_paged_pages, which refuses it before any check)
    own_daemons.extend(start_many([{"env": engine_env(RAILS["a"], max_paged_pages=n)}]))
    async with nodes(*own_daemons) as (a,):
        src, dst = await a.region(PAGE), await a.region(PAGE)
        pages = Pages([0] * n, 1)
        ended = refused = 0
        for _ in range(12):
            wordbuf = await a.client.alloc_buffer(PAGE)
            w = await a.client.alloc_uvm_watcher(lambda old, new: None, buffer=wordbuf)
            await a.client.free_buffer(wordbuf)
            await asyncio.sleep(random.uniform(0, 0.5))  # anywhere in the sweep's period
            try:
                c = await a.client.arm_paged_writes(w, 1, 1, None, (src.mr, pages),
                                                    (dst.desc, pages))
            except NotFound:
                refused += 1  # the sweep came first
                continue
            with pytest.raises(NotFound, match=f"watcher {w.id} ended"):
                await c.wait(3.0)
            ended += 1
        assert ended + refused == 12
