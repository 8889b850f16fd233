"""Several host domain groups in one daemon (engine.host_groups), on either worker.

Each group binds every rail on ports of its own; registered regions are dealt to the
groups in turn and a region's MrDesc names its group's rails.  Writes between every
pair of groups of two daemons land (sha256 of the whole destination), count once per
write, and the metrics add up every group's tallies.  Out-of-range settings stop the
daemon at start with the key named.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from client import Client, MrDesc, NetAddr, Pages
from tests.helpers import async_test, digest, metric, scrape
from tests.integration.engine_cluster import (
    WAIT,
    engine_env,
    fresh_imm,
    nodes,
    secret_file,
    settle,
    start_many,
    tcp_rails,
)
from tests.integration.test_cli import RPC_SERVER, run_cli
from transferd.exits import Exit
from transferd.protocol.errors import Cancelled

GROUPS = 3
RAILS_A = ("127.0.0.8", "127.0.0.9")
RAILS_B = ("127.0.0.10", "127.0.0.11")
SIZE = 256 << 10


@pytest.mark.parametrize("worker", ["loop", "thread"])
@async_test(timeout=90)
async def test_writes_between_every_pair_of_groups_land_and_count(worker: str) -> None:
    env = {"host_groups": GROUPS, "worker": worker, "secret_file": secret_file()}
    da, db = start_many([{"env": engine_env(RAILS_A, **env)},
                         {"env": engine_env(RAILS_B, **env)}])
    try:
        async with nodes(da, db) as (a, b):
            main = await a.client.main_address()
            srcs = [await a.region(SIZE, seed=40 + i) for i in range(GROUPS)]
            dsts = [await b.region(SIZE) for _ in range(GROUPS)]
            # Dealt in turn: each region's rails are its group's, GROUPS distinct sets,
            # all on the same hosts (one port per group and rail).
            groups = {d.desc.rkeys[0][0].group for d in dsts}
            assert groups == set(range(GROUPS)), groups
            ports = {p for d in dsts for _, p in (tcp_rails(n)[0] for n, _ in d.desc.rkeys)}
            assert len(ports) == 2 * GROUPS
            assert {h for d in dsts for n, _ in d.desc.rkeys for h, _ in tcp_rails(n)} == \
                set(RAILS_B)
            assert main.group == 0

            imm = fresh_imm()
            done = []
            page = 4096
            for i, s in enumerate(srcs):
                for j, d in enumerate(dsts):
                    # Every (source group, destination group) pair its own 3 pages.
                    base = (i * GROUPS + j) * 3 * page
                    done.append(await a.client.submit_single_write(
                        page, imm, (s.mr, base), (d.desc, base)))
                    d.data[base:base + page] = s.data[base:base + page]
                    # Two pages, swapped on the way: source pages 0, 1 to destination 1, 0.
                    first = base + page
                    done.append(await a.client.submit_paged_writes(
                        page, imm, (s.mr, Pages([0, 1], page, first)),
                        (d.desc, Pages([1, 0], page, first))))
                    d.data[first:first + page] = s.data[first + page:first + 2 * page]
                    d.data[first + page:first + 2 * page] = s.data[first:first + page]
            assert await settle(done) == [None] * len(done)
            # One count per single write, one per page: 3 per pair.
            await asyncio.wait_for(b.client.expect_imm_count(imm, GROUPS * GROUPS * 3), WAIT)
            for d in dsts:
                assert digest(await b.read(d)) == digest(d.data)
            # The metrics add every group's tallies: each pair's 2 WRITE frames.
            assert db.metrics_url is not None
            m = scrape(db.metrics_url)
            assert metric(m, "transferd_engine_landed_writes_total") >= 2 * GROUPS * GROUPS
            assert metric(m, "transferd_engine_landed_bytes_total") >= 3 * page * GROUPS ** 2
            links = sum(v for k, v in m.items() if k.startswith("transferd_engine_inbound_links"))
            assert links >= GROUPS * 2  # every group of a wrote to every group of b, each rail
            assert metric(m, "transferd_engine_transfers_in_flight") == 0
    finally:
        for daemon in (da, db):
            daemon.stop()


@pytest.mark.parametrize(("env", "says"), [
    ({"TRANSFERD_ENGINE_HOST_GROUPS": "9"}, "engine.host_groups"),
    ({"TRANSFERD_ENGINE_HOST_GROUPS": "0"}, "engine.host_groups"),
    ({"TRANSFERD_ENGINE_WORKER": "fiber"}, "engine.worker"),
])
def test_out_of_range_settings_stop_the_daemon_naming_the_key(env: dict[str, str],
                                                             says: str) -> None:
    r = run_cli([*RPC_SERVER, "-p", "0", "--metrics-port", "-1"], **env)
    assert r.returncode == Exit.CONFIG, r.stderr
    assert says in r.stderr


@pytest.mark.parametrize("worker", ["loop", "thread"])
@async_test(timeout=60)
async def test_cancel_reaches_the_group_a_write_runs_on(worker: str, daemon_factory: Any) -> None:
    """A write to a peer that never answers, from a region of each group: CANCEL ends each
    on its own group's worker, exactly once, and the slots come back."""
    d = daemon_factory(env={"TRANSFERD_ENGINE_HOST_GROUPS": "2",
                            "TRANSFERD_ENGINE_WORKER": worker})
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # never accepted, never read
    try:
        async with await Client.connect(d.url) as c:
            mine = []
            for _ in range(2):
                buf = await c.alloc_buffer(1 << 20)
                mine.append((buf, (await c.reg_mr(buf))[0]))
            dst = MrDesc(1 << 20, [(NetAddr(0x5157, 0, (silent.getsockname(),)), 0x1234)],
                         1 << 20)
            ws = [await c.submit_single_write(4096, None, (mr, 0), (dst, 0)) for _, mr in mine]
            await asyncio.sleep(0.1)
            assert not any(w.done() for w in ws)
            for w in ws:
                assert await w.cancel() is True
                with pytest.raises(Cancelled):
                    await w
                assert await w.cancel() is False
            await asyncio.wait_for(c.synchronize(), 5)
            assert d.metrics_url is not None
            assert metric(scrape(d.metrics_url), "transferd_engine_transfers_in_flight") == 0
            for buf, _ in mine:
                await c.free_buffer(buf)
    finally:
        silent.close()
