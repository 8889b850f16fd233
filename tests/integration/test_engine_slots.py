"""Engine slots per client (issue 11): one client's writes to a silent peer do not take
the worker's 4,096 slots shared by all, so another client's write to a healthy peer
completes at once instead of after the peer timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from client import Client
from tests.helpers import DaemonProcess, async_test, metric, scrape
from tests.integration.engine_cluster import (
    RAILS,
    WAIT,
    engine_env,
    nodes,
    settle,
    start_many,
    stopped,
)


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
