"""Rail failover between two hosts (network namespaces, two rate-limited veth rails).

A write split over both rails is under way when one rail is cut (``ip link set down`` on
A's end of its veth): the kernel gives up on the part in flight after
``engine.rail_timeout_s`` (TCP_USER_TIMEOUT), the part is re-sent on the other rail, and
the write completes -- every byte checked, its immediate counted once.  Paged writes that
run while the rail is down go over the remaining one.  Once the rail is back up
(``ip link set up``), it carries traffic again.

The topology comes from :mod:`benchmarks.netns` (as in test_multihost.py); skipped, with
the reason, where the machine does not allow namespaces.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from collections.abc import Iterator

import pytest

from benchmarks import netns
from client import Client, Pages
from tests.helpers import DaemonProcess, digest, pattern, run

pytestmark = [pytest.mark.netns, pytest.mark.timeout(180)]

RATE_MBIT = 200
MiB = 1 << 20
SIZE = 32 * MiB  # 16 MiB a rail: ~0.7 s at 200 Mbit/s
PAGE = 64 * 1024
RAIL_TIMEOUT_S = 1.0
WAIT = 60.0


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[netns.Topology, DaemonProcess, DaemonProcess]]:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    topo = netns.Topology(rails=2, rate_mbit=RATE_MBIT)
    try:
        topo.create()
    except netns.NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    started: list[DaemonProcess] = []
    try:
        extra = f"rail_timeout_s = {RAIL_TIMEOUT_S}\npeer_timeout_s = 30\n"
        for host in (topo.a, topo.b):
            cfg = host.engine_config(2, topo.workdir, extra)
            started.append(DaemonProcess(command=host.daemon_argv(cfg)).start())
        for d in started:
            d.wait_ready()
        yield topo, started[0], started[1]
    finally:
        for d in started:
            d.stop()
        print("\n".join(d.output()[-3000:] for d in started))
        topo.close()


def link(topo: netns.Topology, side: str, rail: int, state: str) -> None:
    ns = (topo.a if side == "a" else topo.b).ns
    subprocess.run(["ip", "-n", ns, "link", "set", f"rail{rail}", state],
                   check=True, timeout=10)


@pytest.mark.parametrize("side", ["a", "b"], ids=["cut-at-sender", "cut-at-receiver"])
def test_a_cut_rail_fails_over_and_comes_back(
    hosts: tuple[netns.Topology, DaemonProcess, DaemonProcess], side: str,
) -> None:
    """Cut at the sender (its sends fail at once: no route) or at the receiver (the
    sender's bytes go unacknowledged until engine.rail_timeout_s)."""
    topo, a_d, b_d = hosts

    async def main() -> None:
        ca = await Client.connect(a_d.url)
        cb = await Client.connect(b_d.url)
        try:
            data = pattern(SIZE, 41)
            src = await ca.alloc_buffer(SIZE)
            dst = await cb.alloc_buffer(SIZE)
            await ca.set_tensor(src.tensor(), data)
            mr, _ = await ca.reg_mr(src)
            _, desc = await cb.reg_mr(dst)
            # Links up on both rails.
            await (await ca.submit_single_write(2 * MiB, None, (mr, 0), (desc, 0))).wait(WAIT)
            await cb.buffer_clear(dst, 0)

            before = [topo.rail_bytes(topo.a, r) for r in range(2)]
            done = await cb.expect_imm_count(701, 1, wait=False)
            t0 = time.monotonic()
            w = await ca.submit_single_write(SIZE, 701, (mr, 0), (desc, 0))
            await asyncio.sleep(0.25)  # both halves under way
            moved = topo.rail_bytes(topo.a, 1) - before[1]
            assert 0 < moved < SIZE // 2, f"rail 1 carried {moved} bytes: not mid-transfer"
            link(topo, side, 1, "down")
            await w.wait(WAIT)
            await done.wait(WAIT)
            took = time.monotonic() - t0
            assert digest(bytes(await cb.get_tensor(dst.tensor()))) == digest(data)
            assert await cb.imm_count(701) == 0  # counted once (and consumed by done)
            print(f"{SIZE >> 20} MiB with rail 1 cut at {side} after 0.25 s: {took:.2f} s")

            # While it is down, paged writes go over rail 0 only, each page counted once.
            rng = random.Random(5)
            n = SIZE // PAGE
            idx = rng.sample(range(n), 64)
            to = rng.sample(range(n), 64)
            await cb.buffer_clear(dst, 0)
            down = topo.rail_bytes(topo.a, 1)
            done = await cb.expect_imm_count(702, 64, wait=False)
            await (await ca.submit_paged_writes(
                PAGE, 702, (mr, Pages(idx, PAGE)), (desc, Pages(to, PAGE)))).wait(WAIT)
            await done.wait(WAIT)
            assert await cb.imm_count(702) == 0
            got = bytes(await cb.get_tensor(dst.tensor()))
            for i, j in zip(idx, to, strict=True):
                assert digest(got[j * PAGE:(j + 1) * PAGE]) == \
                    digest(data[i * PAGE:(i + 1) * PAGE]), f"page {i} -> {j}"
            assert topo.rail_bytes(topo.a, 1) - down < 64 * 1024, "a down rail carried pages"

            # Back up: within a few writes (each after the rail's back-off), rail 1 is
            # used again, and the bytes are still right.
            link(topo, side, 1, "up")
            back = topo.rail_bytes(topo.a, 1)
            writes = 0
            while topo.rail_bytes(topo.a, 1) - back <= MiB:
                writes += 1
                assert writes <= 40, "rail 1 never carried a part again"  # 20 s at most
                await asyncio.sleep(0.5)
                await (await ca.submit_single_write(4 * MiB, None, (mr, 0),
                                                    (desc, 0))).wait(WAIT)
            print(f"rail 1 used again after {writes} write(s)")
            got = bytes(await cb.get_tensor(dst.tensor(0, 4 * MiB)))
            assert digest(got) == digest(data[:4 * MiB])
        finally:
            await ca.close()
            await cb.close()

    run(main(), timeout=120)
