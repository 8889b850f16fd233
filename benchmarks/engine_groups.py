"""(h) Domain groups: 1, 2 and 4 host groups of one daemon, on either kind of worker.

Two pairs of daemons run ``engine.host_groups = 4`` (host groups standing in for
GPUs): one with ``engine.worker = "loop"`` (every group on the daemon's own loop),
one with ``"thread"`` (a worker thread per group).  On each, the client registers
one source region per group on A and one destination region per group on B
(regions are dealt to the groups in turn), so that using k of them puts the work
on k groups of the same daemons while everything else stays as it was:

- the aggregate 4 KiB write rate: k client connections, one per group used,
  ``WINDOW`` writes in flight in all (``WINDOW / k`` each, so only the number of
  groups changes), each from its group's region to the matching region of B, for
  ``seconds``; completions per second, all connections together;
- bulk throughput: ``BULK`` bytes as ``PARTS`` single writes submitted at once,
  dealt over the k groups' regions (k = 1: all four from one group); bytes over
  the time to the last completion.

Every round measures k = 1, 2, 4 on both pairs in alternating order; each figure is
the median over rounds and each ratio (k groups / 1 group, thread / loop) is taken
within a round, then the median.  Placement as for every engine figure: A and the
client on one CPU, B on the other -- each daemon has one core, so groups can share
it but never run beside each other; what that and the interpreter lock leave of
more groups is the figure (docs/benchmarks.md, issue 12; the worker-process design
that would lift the lock and its hand-off are in "How cost grows", (4)).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections.abc import Iterator
from typing import Any

from .engine_common import SECTION, GiB, MiB, Sides, client_on, crc_remote, sides, start_pair
from .harness import BenchResult, Check, Options, Table, fmt_ratio, interleave, median

NAME = "engine_groups"
TITLE = "(h) 1, 2 and 4 host domain groups: aggregate 4 KiB write rate and bulk throughput"
SECTION = SECTION

GROUPS = 4
USED = (1, 2, 4)
KINDS = ("loop", "thread")
WINDOW = 32
SMALL = 4096
PARTS = 4
FILL = 0x5A


class _Pair:
    """A client of a daemon pair with GROUPS groups: a region per group on each side."""

    def __init__(self, a_url: str, b_url: str, part: int) -> None:
        import uvloop

        self.a_url, self.b_url, self.part = a_url, b_url, part
        self.loop = uvloop.new_event_loop()
        self.loop.run_until_complete(self._setup())

    async def _setup(self) -> None:
        from client import Client

        self.ca = [await Client.connect(self.a_url) for _ in range(GROUPS)]
        self.cb = await Client.connect(self.b_url)
        self.srcs: list[Any] = []
        self.dsts: list[Any] = []
        for i in range(GROUPS):
            s = await self.ca[i].alloc_buffer(self.part)
            await self.ca[i].buffer_clear(s, FILL)
            mr, _ = await self.ca[i].reg_mr(s)
            d = await self.cb.alloc_buffer(self.part)
            await self.cb.buffer_clear(d, 0)
            _, desc = await self.cb.reg_mr(d)
            self.srcs.append(mr)
            self.dsts.append((d, desc))
        groups = sorted({desc.rkeys[0][0].group for _, desc in self.dsts})
        if groups != list(range(GROUPS)):
            raise AssertionError(f"{GROUPS} regions landed in groups {groups}")

    async def _rate(self, k: int, seconds: float) -> float:
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + seconds
        window = WINDOW // k
        done = 0

        async def pump(i: int) -> None:
            nonlocal done
            c, src, dst = self.ca[i], (self.srcs[i], 0), (self.dsts[i][1], 0)
            inflight: list[Any] = []
            while loop.time() < stop_at:
                while len(inflight) < window:
                    inflight.append(await c.submit_single_write(SMALL, None, src, dst))
                await inflight.pop(0)
                done += 1
            for x in inflight:
                await x
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(pump(i) for i in range(k)))
        return done / (time.perf_counter() - t0)

    async def _bulk(self, k: int) -> float:
        t0 = time.perf_counter()
        comps = []
        for j in range(PARTS):
            i = j % k
            comps.append(await self.ca[i].submit_single_write(
                self.part, None, (self.srcs[i], 0), (self.dsts[i][1], 0)))
        for x in comps:
            await x
        return PARTS * self.part / (time.perf_counter() - t0)

    def measure(self, k: int, seconds: float) -> dict[str, float]:
        rate = self.loop.run_until_complete(self._rate(k, seconds))
        return {"rate": rate, "bulk_Bps": self.loop.run_until_complete(self._bulk(k))}

    def check(self) -> None:
        async def check() -> None:
            want = zlib.crc32(bytes([FILL]) * self.part)
            for i, (d, _) in enumerate(self.dsts):
                if await crc_remote(self.cb, d, self.part) != want:
                    raise AssertionError(f"group {i}: B's region does not hold the bytes")

        self.loop.run_until_complete(check())

    def close(self) -> None:
        async def close() -> None:
            for c in (*self.ca, self.cb):
                await c.close()

        self.loop.run_until_complete(close())
        self.loop.close()


@contextlib.contextmanager
def _pairs(s: Sides, part: int) -> Iterator[dict[str, _Pair]]:
    daemons = []
    pairs: dict[str, _Pair] = {}
    try:
        for kind in KINDS:
            a, b = start_pair(s, env={"TRANSFERD_ENGINE_WORKER": kind,
                                      "TRANSFERD_ENGINE_HOST_GROUPS": str(GROUPS)})
            daemons += [a, b]
            with client_on(s.initiator):
                pairs[kind] = _Pair(a.url, b.url, part)
        yield pairs
    finally:
        for p in pairs.values():
            p.close()
        for d in daemons:
            d.stop()


def run(opts: Options) -> BenchResult:
    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    rounds = opts.pick(6, 2)
    bulk = opts.pick(1 * GiB, 128 * MiB)
    seconds = opts.pick(1.0, 0.3)
    configs = [(kind, k) for kind in KINDS for k in USED]
    per_round: dict[str, list[dict[str, float]]] = {f"{kind} x{k}": [] for kind, k in configs}
    with _pairs(s, bulk // PARTS) as pairs, client_on(s.initiator):
        for kind, p in pairs.items():
            p.measure(1, seconds / 3)  # warm every link
            opts.log(f"{kind}: ready")
        for r, (kind, k) in interleave(configs, rounds):
            per_round[f"{kind} x{k}"].append(pairs[kind].measure(k, seconds))
            opts.log(f"round {r} {kind} x{k}: {per_round[f'{kind} x{k}'][-1]}")
        for p in pairs.values():
            p.check()

    def ratio(num: str, den: str, q: str) -> float:
        return median([x[q] / y[q] for x, y in zip(per_round[num], per_round[den], strict=True)])

    summary = {name: {q: median([x[q] for x in rows]) for q in ("rate", "bulk_Bps")}
               for name, rows in per_round.items()}
    table = Table(f"{rounds} alternating rounds on two daemon pairs of {GROUPS} groups each; "
                  f"4 KiB: one connection per group used, {WINDOW} in flight in all, "
                  f"{seconds:g} s; bulk: {bulk >> 20} MiB as {PARTS} writes dealt over the "
                  "groups used (medians; ratios per round)",
                  ["worker", "groups", "4 KiB writes/s", "vs 1 group", "vs loop",
                   "bulk MiB/s", "vs 1 group", "vs loop"])
    for kind, k in configs:
        name, one, lp = f"{kind} x{k}", f"{kind} x1", f"loop x{k}"
        v = summary[name]
        table.add(kind, k, f"{v['rate']:,.0f}", fmt_ratio(ratio(name, one, "rate")),
                  fmt_ratio(ratio(name, lp, "rate")), f"{v['bulk_Bps'] / MiB:,.0f}",
                  fmt_ratio(ratio(name, one, "bulk_Bps")), fmt_ratio(ratio(name, lp, "bulk_Bps")))
    res.tables.append(table)
    for kind in KINDS:
        # More groups must not cost the host rate more than a tenth.
        res.checks.append(Check(f"(h) {kind} worker: 4 KiB rate, 4 groups / 1 group",
                                ratio(f"{kind} x4", f"{kind} x1", "rate"), ">=", 0.9, "x"))
    res.notes.append(f"placement: {s.describe()}")
    if s.initiator.server is not None:
        res.notes.append("each daemon is pinned to one CPU: groups can share that core, never "
                         "run beside each other")
    else:
        res.notes.append("nothing pinned: the daemons, the client and their groups' threads "
                         "share every allowed CPU")
    res.data = {"rounds": rounds, "bulk": bulk, "parts": PARTS, "seconds": seconds,
                "window": WINDOW, "summary": summary, "per_round": per_round,
                "placement": s.describe()}
    return res
