"""(i) The engine in the caller's process (issue 21): ``Client.connect("inproc://")``.

Arms, in alternating rounds, placed as every engine figure (benchmarks.engine_common):
this process, which holds the inproc engine and the daemon path's client, on the
initiator side's CPU with daemon A; daemon B and the eight scatter peers on the
target side's CPU.

- ``inproc -> daemon``: the engine runs in this process (one rail on loopback, as
  the daemons'), its source a numpy array registered where it lies; a write is two
  hops: this process -> B, B's ACK -> this process.
- ``daemon path``: the client of daemon A in this process, the same write through
  A: client -> A -> B -> A -> client.
- ``plain socket`` (4 KiB only): 8-byte length + 4 KiB ``sendall``, ``recv_into``,
  one byte back, between two processes on the same two CPUs.
- ``Mooncake TE (tcp)``, ``NIXL (UCX tcp)`` (4 KiB only): their engines in the two
  processes of engine_peers.py, where the benchmark venv has them.

Figures: the 4 KiB write's p50 and p99 (``n`` sequential writes per round, each timed
from submit to completion), one 1 GiB write (submit to completion), one paged write
of 4096 x 16 KiB pages (64 MiB, pages reversed on the way), and a scatter of 4 MiB to
each of 8 peer daemons (one submit).  Every byte is checked once at the end (CRC at
the destinations).  Targets (issue 21): the 4 KiB p50 at most 1.2x the plain
socket's and at most Mooncake's; the 1 GiB write at least the daemon path's rate;
paged and scatter reported against the daemon path.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

import numpy as np

from .engine_common import (
    LABELS,
    GiB,
    MiB,
    client_on,
    crc_remote,
    only_running,
    sides,
    start_pair,
    start_peers,
    write_rtts,
)
from .harness import (
    BenchResult,
    Check,
    Options,
    ServerProcess,
    Table,
    daemon_command,
    fmt_rate,
    fmt_ratio,
    fmt_us,
    interleave,
    median,
    percentile,
    quiet_gc,
)
from .scale_peers import start_all

NAME = "engine_inproc"
TITLE = "(i) the engine in the caller's process: 4 KiB, 1 GiB, paged, scatter vs the daemon path"
SECTION = "The engine in the caller's process (issue 21)"

SMALL = 4096
PAGE = 16 * 1024
PAGES = 4096
SCATTER_PEERS = 8
SCATTER_EACH = 4 * MiB
PEER_KINDS = ("socket", "mooncake", "nixl")
INPROC = "inproc -> daemon"
DAEMON = "daemon path (client -> A -> B)"
TIMEOUT = 120.0


class Side:
    """One initiator (an inproc engine, or daemon A's client) writing into B and the peers."""

    def __init__(self, client: Any, cb: Any, peers: list[Any], big: int) -> None:
        self.c, self.cb, self.peers, self.big = client, cb, peers, big

    async def setup(self, own: bool) -> None:
        big = self.big
        raw = bytearray(np.random.default_rng(21).bytes(big))
        self.crc = zlib.crc32(raw)
        data = np.frombuffer(raw, dtype=np.uint8)
        if own:  # the caller's own array, registered where it lies
            self._array = data
            src = await self.c.register_memory(data)
        else:
            src = await self.c.alloc_buffer(big)
            for off in range(0, big, 64 * MiB):
                await self.c.set_tensor(src.tensor(off, min(64 * MiB, big - off)),
                                        data[off: off + 64 * MiB])
        self.src = src
        self.mr, _ = await self.c.reg_mr(src)
        self.dst = await self.cb.alloc_buffer(big)
        await self.cb.buffer_clear(self.dst, 0)
        _, self.desc = await self.cb.reg_mr(self.dst)
        self.pdst = []
        for p in self.peers:
            b = await p.alloc_buffer(SCATTER_EACH)
            await p.buffer_clear(b, 0)
            self.pdst.append((b, (await p.reg_mr(b))[1]))
        self.group = await self.c.add_peer_group([d.rkeys[0][0] for _, d in self.pdst])

    async def lat(self, n: int) -> list[float]:
        return await write_rtts(self.c, self.mr, self.desc, SMALL, n)

    async def bulk(self) -> float:
        t0 = time.perf_counter()
        await asyncio.wait_for((await self.c.submit_single_write(
            self.big, None, (self.mr, 0), (self.desc, 0))).wait(), TIMEOUT)
        return time.perf_counter() - t0

    async def paged(self) -> float:
        from client import Pages

        src = Pages(list(range(PAGES)), PAGE, 0)
        dst = Pages(list(reversed(range(PAGES))), PAGE, 0)
        t0 = time.perf_counter()
        await asyncio.wait_for((await self.c.submit_paged_writes(
            PAGE, None, (self.mr, src), (self.desc, dst))).wait(), TIMEOUT)
        return time.perf_counter() - t0

    async def scatter(self) -> float:
        from client import ScatterDst

        dsts = [ScatterDst(SCATTER_EACH, i * SCATTER_EACH, (d, 0))
                for i, (_, d) in enumerate(self.pdst)]
        t0 = time.perf_counter()
        await asyncio.wait_for((await self.c.submit_scatter(
            self.group, None, self.mr, dsts)).wait(), TIMEOUT)
        return time.perf_counter() - t0

    async def check(self) -> bool:
        """B holds the whole source (the bulk write was last); each peer its slice."""
        ok = await crc_remote(self.cb, self.dst, self.big) == self.crc
        for i, (b, _) in enumerate(self.pdst):
            want = await self.c.get_tensor(self.src.tensor(i * SCATTER_EACH, SCATTER_EACH))
            got = await self.peers[i].get_tensor(b.tensor())
            ok = ok and zlib.crc32(got) == zlib.crc32(want)
        return ok


async def _arms(a: ServerProcess, b: ServerProcess, peers: list[ServerProcess], big: int
                ) -> tuple[dict[str, Side], list[Any]]:
    from client import Client

    cb = await Client.connect(b.url)
    pcs = [await Client.connect(p.url) for p in peers]
    me = await Client.connect("inproc://")
    ca = await Client.connect(a.url)
    arms = {INPROC: Side(me, cb, pcs, big), DAEMON: Side(ca, cb, pcs, big)}
    await arms[INPROC].setup(own=True)
    await arms[DAEMON].setup(own=False)
    return arms, [me, ca, cb, *pcs]


def run(opts: Options) -> BenchResult:
    import uvloop

    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    n = opts.pick(2000, 300)
    rounds = opts.pick(6, 2)
    big = opts.pick(GiB, 256 * MiB)
    loop = uvloop.new_event_loop()
    a, b = start_pair(s)
    peers = start_all([daemon_command() for _ in range(SCATTER_PEERS)], s.target,
                      [f"peer {i}" for i in range(SCATTER_PEERS)])
    clients: list[Any] = []
    pairs: dict[str, Any] = {}
    try:
        with client_on(s.initiator):
            arms, clients = loop.run_until_complete(_arms(a, b, peers, big))
        opts.log("transferd: ready")
        pairs, missing = start_peers(PEER_KINDS, MiB, s, opts.log)
        lat: dict[str, list[dict[str, float]]] = {}
        bulk: dict[str, list[float]] = {k: [] for k in arms}
        paged: dict[str, list[float]] = {k: [] for k in arms}
        scatter: dict[str, list[float]] = {k: [] for k in arms}
        small: dict[str, Any] = {**arms, **{LABELS[k]: p for k, p in pairs.items()}}
        with client_on(s.initiator):
            for arm in small.values():
                only_running(pairs.values(), arm)
                if isinstance(arm, Side):
                    loop.run_until_complete(arm.lat(opts.pick(300, 50)))
                else:
                    arm.lat(opts.pick(300, 50), SMALL)
            for r, name in interleave(list(small), rounds):
                arm = small[name]
                only_running(pairs.values(), arm)
                with quiet_gc():
                    xs = loop.run_until_complete(arm.lat(n)) if isinstance(arm, Side) \
                        else arm.lat(n, SMALL)
                lat.setdefault(name, []).append({"p50": percentile(xs, 50),
                                                 "p99": percentile(xs, 99)})
                opts.log(f"round {r} {name}: p50 {fmt_us(lat[name][-1]['p50'])} us")
            # The baselines' part is done: none of them runs beside the bulk rounds.
            for pair in pairs.values():
                pair.stop()
            pairs = {}
            for arm in arms.values():  # warm: links on every rail, B's and peers' pages
                for step in (arm.paged, arm.scatter, arm.bulk):
                    loop.run_until_complete(step())
            for r, name in interleave(list(arms), rounds):
                arm = arms[name]
                paged[name].append(loop.run_until_complete(arm.paged()))
                scatter[name].append(loop.run_until_complete(arm.scatter()))
                bulk[name].append(loop.run_until_complete(arm.bulk()))
                opts.log(f"round {r} {name}: 1 GiB {fmt_rate(big / bulk[name][-1])}")
            for name, arm in arms.items():
                if not loop.run_until_complete(arm.check()):
                    raise AssertionError(f"{name}: the destinations do not hold the source")
    finally:
        async def close() -> None:
            for c in clients:
                await c.close()

        loop.run_until_complete(close())
        loop.close()
        for pair in pairs.values():
            pair.stop()
        for p in (a, b, *peers):
            p.stop()

    floor = LABELS["socket"]

    def ratio(name: str, q: str, base: str) -> float:
        if base not in lat:
            return float("nan")
        return median([x[q] / f[q] for x, f in zip(lat[name], lat[base], strict=True)])

    t = Table(f"4 KiB write, submit to completion, {rounds} alternating rounds x {n} writes "
              "(median over rounds; us)",
              ["arm", "p50 us", "p99 us", "p50 / plain socket's", "p50 / daemon path's"])
    for name, rows in lat.items():
        t.add(name, fmt_us(median([x["p50"] for x in rows])),
              fmt_us(median([x["p99"] for x in rows])), fmt_ratio(ratio(name, "p50", floor)),
              fmt_ratio(ratio(name, "p50", DAEMON)))
    for kind, why in missing.items():
        t.add(LABELS[kind], "-", "-", "-", f"not available: {why}")
    res.tables.append(t)
    t2 = Table(f"Bulk, paged and scatter, {rounds} alternating rounds (median; rate = bytes / "
               "submit-to-completion time)",
               ["figure", "inproc", "daemon path", "inproc / daemon path (rate)"])
    for label, xs, nbytes in [(f"{big // MiB} MiB single write", bulk, big),
                              (f"paged {PAGES} x {PAGE // 1024} KiB", paged, PAGES * PAGE),
                              (f"scatter {SCATTER_EACH // MiB} MiB to {SCATTER_PEERS} peers",
                               scatter, SCATTER_PEERS * SCATTER_EACH)]:
        i, d = median(xs[INPROC]), median(xs[DAEMON])
        t2.add(label, fmt_rate(nbytes / i), fmt_rate(nbytes / d), fmt_ratio(d / i))
    res.tables.append(t2)
    if floor in lat:
        res.checks.append(Check("(i) 4 KiB p50, inproc / plain socket",
                                ratio(INPROC, "p50", floor), "<=", 1.2, "x"))
    moon = LABELS["mooncake"]
    if moon in lat:
        res.checks.append(Check(f"(i) 4 KiB p50, inproc / {moon}",
                                ratio(INPROC, "p50", moon), "<=", 1.0, "x"))
    res.checks.append(Check("(i) 1 GiB rate, inproc / daemon path",
                            median(bulk[DAEMON]) / median(bulk[INPROC]), ">=", 1.0, "x"))
    res.data = {"lat": lat, "bulk_s": bulk, "paged_s": paged, "scatter_s": scatter,
                "big": big, "missing": missing}
    return res
