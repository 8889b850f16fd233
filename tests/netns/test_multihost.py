"""Two hosts in network namespaces, two rate-limited rails between them.

The topology (shared with the rails benchmark) is built by
:mod:`benchmarks.netns`: namespaces ``...-a`` and ``...-b`` joined by veth
rails 198.18.r.1 <-> 198.18.r.2, each limited by ``tc tbf`` to :data:`RATE_MBIT`
on both ends, and a management veth from this (root) namespace to each, where
the daemons' client RPC port listens.  One daemon runs in each namespace
(``ip netns exec NS rpc-server -c CONFIG ...``) per pair; a 1-rail pair and a
2-rail pair share the namespaces.  Every byte between daemons crosses the rails.

Skipped, with the reason, where the machine does not allow namespaces (not
root, no iproute2, ``ip netns add`` refused).  The namespaces are deleted when
the module's tests end, failed or not.

The speed check is deliberately loose (two rails > 1.5x one rail on the same
links); the precise figure is ``python -m benchmarks --only engine_rails``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from benchmarks import netns
from client import Client, MrDesc, MrHandle, Pages, RemoteBuffer
from tests.helpers import DaemonProcess, digest, pattern, run
from transferd.domains.rails import parse_rail

pytestmark = [pytest.mark.netns, pytest.mark.timeout(180)]

RATE_MBIT = 300
MiB = 1 << 20
SIZE = 24 * MiB  # ~0.7 s over one rail at 300 Mbit/s
PAGE = 16 * 1024
WAIT = 60.0


class Pair:
    def __init__(self, a: DaemonProcess, b: DaemonProcess, rails: int) -> None:
        self.a, self.b, self.rails = a, b, rails


@pytest.fixture(scope="module")
def topology() -> Iterator[netns.Topology]:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    topo = netns.Topology(rails=2, rate_mbit=RATE_MBIT)
    try:
        topo.create()
    except netns.NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    try:
        yield topo
    finally:
        topo.close()


@pytest.fixture(scope="module")
def pairs(topology: netns.Topology) -> Iterator[dict[int, Pair]]:
    started: list[DaemonProcess] = []
    out: dict[int, Pair] = {}
    try:
        for rails in (1, 2):
            ds = []
            for host in (topology.a, topology.b):
                cfg = host.engine_config(rails, topology.workdir)
                d = DaemonProcess(command=host.daemon_argv(cfg))
                started.append(d)
                ds.append(d.start())
            for d in ds:
                d.wait_ready()
            out[rails] = Pair(ds[0], ds[1], rails)
        yield out
    finally:
        failed = any(not d.alive() for d in started)
        for d in started:
            d.stop()
            if failed:
                print(d.output())


@dataclass
class Setup:
    ca: Client
    cb: Client
    src: RemoteBuffer
    dst: RemoteBuffer
    mr: MrHandle
    desc: MrDesc
    data: bytes

    async def close(self) -> None:
        await self.ca.close()
        await self.cb.close()


async def _setup(pair: Pair, size: int, seed: int) -> Setup:
    """A source on A filled with a pattern, a zeroed destination on B, both registered."""
    ca = await Client.connect(pair.a.url)
    cb = await Client.connect(pair.b.url)
    src = await ca.alloc_buffer(size)
    dst = await cb.alloc_buffer(size)
    data = pattern(size, seed)
    await ca.set_tensor(src.tensor(), data)
    await cb.buffer_clear(dst, 0)
    mr, _ = await ca.reg_mr(src)
    _, desc = await cb.reg_mr(dst)
    return Setup(ca, cb, src, dst, mr, desc, data)


def test_daemons_live_in_their_namespaces(topology: netns.Topology,
                                          pairs: dict[int, Pair]) -> None:
    async def main() -> None:
        for pair in pairs.values():
            async with await Client.connect(pair.a.url) as ca, \
                    await Client.connect(pair.b.url) as cb:
                aa, ab = await ca.main_address(), await cb.main_address()
                assert [parse_rail(r)[0] for r in aa.rails] == topology.a.rails[: pair.rails]
                assert [parse_rail(r)[0] for r in ab.rails] == topology.b.rails[: pair.rails]

    run(main(), timeout=WAIT)


def test_write_across_hosts_with_checksums(topology: netns.Topology,
                                           pairs: dict[int, Pair]) -> None:
    """A single write and paged writes A -> B over both rails land byte for byte."""
    pair = pairs[2]
    size = 8 * MiB
    before = [topology.rail_bytes(topology.a, r) for r in range(2)]

    async def main() -> None:
        s = await _setup(pair, size, seed=3)
        try:
            # A single write of 4 MiB at offset 1 MiB (split over both rails), counted once.
            off, n = 1 * MiB, 4 * MiB
            done = await s.cb.expect_imm_count(901, 1, wait=False)
            await (await s.ca.submit_single_write(n, 901, (s.mr, 0), (s.desc, off))).wait(WAIT)
            await done.wait(WAIT)
            got = bytes(await s.cb.get_tensor(s.dst.tensor()))
            assert digest(got[off : off + n]) == digest(s.data[:n])
            assert got[:off] == bytes(off)
            assert got[off + n :] == bytes(size - off - n)

            # 64 pages of 16 KiB from random source pages to random destination pages.
            rng = random.Random(7)
            npages = size // PAGE
            src_idx = rng.sample(range(npages), 64)
            dst_idx = rng.sample(range(npages), 64)
            await s.cb.buffer_clear(s.dst, 0)
            done = await s.cb.expect_imm_count(902, 64, wait=False)
            await (await s.ca.submit_paged_writes(
                PAGE, 902, (s.mr, Pages(src_idx, PAGE)), (s.desc, Pages(dst_idx, PAGE))
            )).wait(WAIT)
            await done.wait(WAIT)
            got = bytes(await s.cb.get_tensor(s.dst.tensor()))
            for i, j in zip(src_idx, dst_idx, strict=True):
                want = s.data[i * PAGE : (i + 1) * PAGE]
                assert digest(got[j * PAGE : (j + 1) * PAGE]) == digest(want), f"page {i}->{j}"
            for j in set(range(npages)) - set(dst_idx):
                assert got[j * PAGE : (j + 1) * PAGE] == bytes(PAGE), f"page {j} was touched"
        finally:
            await s.close()

    run(main(), timeout=WAIT)
    moved = [topology.rail_bytes(topology.a, r) - before[r] for r in range(2)]
    # The 4 MiB write went half over each rail (plus pages): both rails carried data.
    assert all(m > 1.5 * MiB for m in moved), f"bytes sent per rail: {moved}"


def test_two_rails_carry_about_twice_one(pairs: dict[int, Pair]) -> None:
    """The same write over two rate-limited rails takes about half as long as over one."""

    async def timed(pair: Pair) -> float:
        s = await _setup(pair, SIZE, seed=pair.rails)
        try:
            # The first write opens the links; the second is timed.
            await (await s.ca.submit_single_write(MiB, None, (s.mr, 0), (s.desc, 0))).wait(WAIT)
            t0 = time.perf_counter()
            await (await s.ca.submit_single_write(SIZE, None, (s.mr, 0), (s.desc, 0))).wait(WAIT)
            elapsed = time.perf_counter() - t0
            got = await s.cb.get_tensor(s.dst.tensor())
            assert digest(got) == digest(s.data), f"{pair.rails}-rail write corrupted data"
            return elapsed
        finally:
            await s.close()

    one: list[float] = []
    two: list[float] = []
    for _ in range(2):  # alternate, so a busy moment hits both
        one.append(run(timed(pairs[1]), timeout=WAIT))
        two.append(run(timed(pairs[2]), timeout=WAIT))
    mbit1 = SIZE * 8 / 1e6 / min(one)
    mbit2 = SIZE * 8 / 1e6 / min(two)
    ratio = mbit2 / mbit1
    print(f"1 rail {mbit1:.0f} Mbit/s, 2 rails {mbit2:.0f} Mbit/s: {ratio:.2f}x "
          f"(each rail limited to {RATE_MBIT} Mbit/s)")
    assert mbit1 < RATE_MBIT * 1.1, "one rail went faster than its tc limit"
    assert ratio > 1.5, f"two rails carried only {ratio:.2f}x one rail"
