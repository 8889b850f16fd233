"""Engine slots per client (issue 11): one client's writes to a silent peer do not take
the worker's 4,096 slots shared by all, so another client's write to a healthy peer
completes at once instead of after the peer timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from client import Client
from tests.helpers import DaemonProcess, async_test, digest, metric, scrape
from tests.integration.engine_cluster import (
    RAILS,
    WAIT,
    engine_env,
    fresh_imm,
    nodes,
    settle,
    start_many,
    stopped,
)
from transferd.protocol.errors import Timeout


@pytest.fixture
def own_daemons() -> Iterator[list[DaemonProcess]]:
    started: list[DaemonProcess] = []
    yield started
    for d in started:
        d.stop()


@async_test(timeout=90)
async def test_one_client_cannot_take_every_engine_slot(
    own_daemons: list[DaemonProcess],
) -> None:
    """4,200 writes to a stopped peer from one client; another's write to a live peer: fast."""
    a_d, b_d, c_d = start_many([
        {"env": engine_env(RAILS["a"], peer_timeout_s=15, max_inflight_per_client=256)},
        {"env": engine_env(RAILS["b"])}, {"env": engine_env(RAILS["c"])}])
    own_daemons += [a_d, b_d, c_d]
    async with nodes(a_d, b_d, c_d) as (a, b, c):
        src = await a.region(4096, seed=5)
        to_b, to_c = await b.region(4096), await c.region(4096)
        for dst in (to_b, to_c):  # links up before b stops
            await (await a.client.submit_single_write(64, None, (src.mr, 0),
                                                      (dst.desc, 0))).wait(WAIT)
        victim = await Client.connect(a_d.url, timeout=WAIT)
        try:
            with stopped(b_d):
                sent: list[object] = []

                async def attack() -> list[object]:
                    for _ in range(4200):
                        sent.append(await a.client.submit_single_write(
                            64, None, (src.mr, 0), (to_b.desc, 0)))
                    return sent
                task = asyncio.ensure_future(attack())
                # Until the daemon holds all it will take of them: every worker
                # slot (before), or this client's share (now).
                held, same = 0, 0
                for _ in range(100):  # 10 s at most
                    await asyncio.sleep(0.1)
                    now = metric(scrape(a_d.metrics_url or ""),
                                 "transferd_engine_transfers_in_flight")
                    same = same + 1 if now == held else 0
                    held = now
                    if held >= 4096 or (held >= 256 and same >= 5):
                        break
                print("attack sent", len(sent), "in flight", held)
                t0 = time.monotonic()
                w = await victim.submit_single_write(64, None, (src.mr, 0), (to_c.desc, 0))
                await w.wait(WAIT)
                took = time.monotonic() - t0
                print("victim write took", took)
                assert took < 3.0, took  # the peer timeout is 15 s
            await settle(await asyncio.wait_for(task, WAIT), WAIT)  # each ends
        finally:
            await victim.close()


@async_test(timeout=120)
async def test_one_silent_peer_cannot_starve_the_others(
    own_daemons: list[DaemonProcess],
) -> None:
    """Two clients flood a stopped peer; their own writes (and a third client's) to a
    live peer complete at once, the flood waits in the peer's queue without a worker slot,
    and once the peer resumes every write of the flood lands, each counted once."""
    per_peer, flood = 64, 400
    a_d, b_d, c_d = start_many([
        {"env": engine_env(RAILS["a"], peer_timeout_s=30, max_inflight_per_peer=per_peer)},
        {"env": engine_env(RAILS["b"])}, {"env": engine_env(RAILS["c"])}])
    own_daemons += [a_d, b_d, c_d]
    async with nodes(a_d, a_d, a_d, b_d, c_d) as (a, x, victim, b, c):
        src = await a.region(flood * 64, seed=7)
        src_x = await x.region(flood * 64, seed=8)
        src_v = await victim.region(4096, seed=9)
        to_b, to_c = await b.region(2 * flood * 64), await c.region(3 * 4096)
        for n, s in ((a, src), (x, src_x), (victim, src_v)):  # every link up first
            for dst in (to_b, to_c):
                await (await n.client.submit_single_write(64, None, (s.mr, 0),
                                                          (dst.desc, 0))).wait(WAIT)
        imm = fresh_imm()
        with stopped(b_d):
            t0 = time.monotonic()
            sent = [await n.client.submit_single_write(64, imm, (s.mr, k * 64),
                                                       (to_b.desc, base + k * 64))
                    for k in range(flood)
                    for n, s, base in ((a, src, 0), (x, src_x, flood * 64))]
            submitted = time.monotonic() - t0
            # At most the peer's share reaches the worker; the rest waits.
            held = metric(scrape(a_d.metrics_url or ""), "transferd_engine_transfers_in_flight")
            assert held <= per_peer, held
            t0 = time.monotonic()
            ws = [await n.client.submit_single_write(4096, None, (s.mr, 0),
                                                     (to_c.desc, i * 4096))
                  for i, (n, s) in enumerate(((a, src), (x, src_x), (victim, src_v)))]
            assert await settle(ws, WAIT) == [None] * 3
            took = time.monotonic() - t0
            print(f"flood of {2 * flood} submitted in {submitted:.2f} s, in flight {held}; "
                  f"three writes to the live peer took {took:.3f} s")
            assert took < 3.0, took  # the peer timeout is 30 s
            assert not any(w.done() for w in sent[per_peer:])
        # B answers again: the flood drains in order, every write lands once.
        assert await settle(sent, WAIT) == [None] * len(sent)
        assert await b.client.imm_count(imm) == 2 * flood
        want = bytes(src.data) + bytes(src_x.data)
        assert digest(await b.read(to_b)) == digest(want)
        got_c = await c.read(to_c)
        for i, s in enumerate((src, src_x, src_v)):
            assert digest(got_c[i * 4096:(i + 1) * 4096]) == digest(bytes(s.data[:4096]))


@async_test(timeout=90)
async def test_a_transfer_that_waits_too_long_is_never_sent(
    own_daemons: list[DaemonProcess],
) -> None:
    """Waiting for a stopped peer's slot ends in TIMEOUT after the peer timeout, and what
    waited was never sent: after the peer resumes, only the writes that were in flight
    can have counted."""
    per_peer, n = 4, 12
    a_d, b_d = start_many([
        {"env": engine_env(RAILS["a"], peer_timeout_s=1.5, max_inflight_per_peer=per_peer)},
        {"env": engine_env(RAILS["b"])}])
    own_daemons += [a_d, b_d]
    async with nodes(a_d, b_d) as (a, b):
        src = await a.region(n * 64, seed=10)
        dst = await b.region(n * 64)
        await (await a.client.submit_single_write(64, None, (src.mr, 0),
                                                  (dst.desc, 0))).wait(WAIT)
        imm = fresh_imm()
        with stopped(b_d):
            ws = [await a.client.submit_single_write(64, imm, (src.mr, k * 64),
                                                     (dst.desc, k * 64)) for k in range(n)]
            errors = await settle(ws, WAIT)
        assert all(isinstance(e, Timeout) for e in errors), errors
        # The first 4 were in flight; of the rest, those still waiting when the 4 timed
        # out expired unsent (others may have started in their place, and timed out).
        never = [k for k, e in enumerate(errors) if "not sent" in str(e)]
        assert len(never) >= n - 2 * per_peer and min(never) >= per_peer, errors
        # A submit's own deadline holds while it waits, too.
        with stopped(b_d):
            busy = [await a.client.submit_single_write(64, None, (src.mr, 0), (dst.desc, 0))
                    for _ in range(per_peer)]
            t0 = time.monotonic()
            w = await a.client.submit_single_write(64, imm, (src.mr, 0), (dst.desc, 0),
                                                   timeout=0.3)
            (err,) = await settle([w])
            took = time.monotonic() - t0
            assert isinstance(err, Timeout) and took < 1.2, (err, took)  # not the 1.5 s
            await settle(busy)
        # B resumed: what was in flight may land late (TIMEOUT is "outcome unknown"),
        # what waited never does.
        for _ in range(10):
            await asyncio.sleep(0.1)
            assert await b.client.imm_count(imm) <= n - len(never)
        got = await b.read(dst)
        for k in never:
            assert got[k * 64:(k + 1) * 64] == bytes(64), k
        # And the peer is usable again.
        w = await a.client.submit_single_write(n * 64, None, (src.mr, 0), (dst.desc, 0))
        await w.wait(WAIT)
        assert digest(await b.read(dst)) == digest(bytes(src.data))
