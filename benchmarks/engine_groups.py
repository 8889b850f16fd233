"""(h) Domain groups: 1, 2 and 4 host groups in one daemon, on either kind of worker.

Daemons A and B both run ``engine.host_groups = N`` (host groups standing in for
GPUs), for N = 1, 2 and 4, with ``engine.worker = "loop"`` (every group on the
daemon's own loop) and ``"thread"`` (a worker thread per group).  The client
registers N source regions on A and N destination regions on B, one in each
group (regions are dealt to the groups in turn), and measures:

- the aggregate 4 KiB write rate: one client connection per group, ``WINDOW``
  writes in flight in all (``WINDOW / N`` on each connection, so that only the
  number of groups changes), from each group's region to the matching region
  of B, for ``seconds``; completions per second, all connections together;
- 1 GiB throughput: 1 GiB split in N equal single writes, one per group, all
  submitted at once; bytes over the time to the last completion.

Configurations run one after another (a pair of daemons each), in alternating
order over rounds; each figure is the median over rounds, and the ratio is
against N = 1 of the same worker kind.  Placement as for every engine figure:
A and the client on one CPU, B on the other -- so the figure shows what extra
groups cost, and what one interpreter lock leaves of them, on one core per
daemon (docs/benchmarks.md, issue 12, says what a worker process per group would
change, with perfscale's measurement of that hand-off).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

from .engine_common import SECTION, GiB, MiB, Sides, client_on, crc_remote, sides, start_pair
from .harness import BenchResult, Check, Options, Table, fmt_ratio, interleave, median

NAME = "engine_groups"
TITLE = "(h) 1, 2 and 4 host domain groups: aggregate 4 KiB write rate and 1 GiB throughput"
SECTION = SECTION

GROUPS = (1, 2, 4)
KINDS = ("loop", "thread")
WINDOW = 32
SMALL = 4096


async def _measure(a_url: str, b_url: str, n: int, bulk: int, seconds: float
                   ) -> dict[str, float]:
    from client import Client

    ca = [await Client.connect(a_url) for _ in range(n)]
    cb = await Client.connect(b_url)
    try:
        part = bulk // n
        srcs, dsts = [], []
        for i in range(n):
            s = await ca[i].alloc_buffer(part)
            await ca[i].buffer_clear(s, 0x30 + i)
            mr, _ = await ca[i].reg_mr(s)
            d = await cb.alloc_buffer(part)
            await cb.buffer_clear(d, 0)
            _, desc = await cb.reg_mr(d)
            srcs.append(mr)
            dsts.append((d, desc))
        groups = sorted({desc.rkeys[0][0].group for _, desc in dsts})
        if groups != list(range(n)):
            raise AssertionError(f"{n} regions landed in groups {groups}")

        # Aggregate 4 KiB rate: WINDOW in flight per connection (one per group).
        loop = asyncio.get_running_loop()
        done = 0
        stop_at = loop.time() + seconds

        window = WINDOW // n

        async def pump(i: int) -> None:
            nonlocal done
            c, src, dst = ca[i], (srcs[i], 0), (dsts[i][1], 0)
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
        await asyncio.gather(*(pump(i) for i in range(n)))
        rate = done / (time.perf_counter() - t0)

        # 1 GiB (bulk) in n single writes, one per group, all at once.
        t0 = time.perf_counter()
        comps = [await ca[i].submit_single_write(part, None, (srcs[i], 0), (dsts[i][1], 0))
                 for i in range(n)]
        for x in comps:
            await x
        secs = time.perf_counter() - t0
        for i, (d, _) in enumerate(dsts):
            want = zlib.crc32(bytes([0x30 + i]) * part)
            if await crc_remote(cb, d, part) != want:
                raise AssertionError(f"group {i}: B's region does not hold the written bytes")
        return {"rate": rate, "bulk_s": secs, "bulk_Bps": part * n / secs}
    finally:
        for c in (*ca, cb):
            await c.close()


def _one(s: Sides, kind: str, n: int, bulk: int, seconds: float) -> dict[str, float]:
    import uvloop

    a, b = start_pair(s, env={"TRANSFERD_ENGINE_WORKER": kind,
                              "TRANSFERD_ENGINE_HOST_GROUPS": str(n)})
    try:
        with client_on(s.initiator):
            return dict(uvloop.run(_measure(a.url, b.url, n, bulk, seconds)))
    finally:
        b.stop()
        a.stop()


def run(opts: Options) -> BenchResult:
    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    rounds = opts.pick(3, 1)
    bulk = opts.pick(1 * GiB, 256 * MiB)
    seconds = opts.pick(2.0, 0.5)
    configs = [(k, n) for k in KINDS for n in GROUPS]
    rows: dict[tuple[str, int], list[dict[str, float]]] = {c: [] for c in configs}
    for r, (kind, n) in interleave(configs, rounds):
        rows[(kind, n)].append(_one(s, kind, n, bulk, seconds))
        opts.log(f"round {r} {kind} x{n}: {rows[(kind, n)][-1]}")
    summary = {f"{k} x{n}": {q: median([x[q] for x in rows[(k, n)]])
                             for q in ("rate", "bulk_Bps")} for k, n in configs}
    table = Table(f"{rounds} round(s), groups in one daemon pair; 4 KiB: one connection per "
                  f"group, {WINDOW} in flight in all, {seconds:g} s; bulk: {bulk >> 20} MiB in "
                  "one write per group (median over rounds)",
                  ["worker", "groups", "4 KiB writes/s", "vs 1 group", "bulk MiB/s",
                   "vs 1 group"])
    for k, n in configs:
        v, one = summary[f"{k} x{n}"], summary[f"{k} x1"]
        table.add(k, n, f"{v['rate']:,.0f}", fmt_ratio(v["rate"] / one["rate"]),
                  f"{v['bulk_Bps'] / MiB:,.0f}", fmt_ratio(v["bulk_Bps"] / one["bulk_Bps"]))
    res.tables.append(table)
    for k in KINDS:
        # Informational bound: more groups must not cost more than a tenth of the rate.
        res.checks.append(Check(f"(h) {k} worker: 4 KiB rate, 4 groups / 1 group",
                                summary[f"{k} x4"]["rate"] / summary[f"{k} x1"]["rate"],
                                ">=", 0.9, "x"))
    res.notes.append(f"placement: {s.describe()}")
    res.notes.append("each daemon is pinned to one CPU: groups can share that core, never "
                     "run beside each other; the thread arms show what the interpreter lock "
                     "and the hand-offs cost on top")
    res.data = {"rounds": rounds, "bulk": bulk, "seconds": seconds, "window": WINDOW,
                "summary": summary,
                "per_round": {f"{k} x{n}": v for (k, n), v in rows.items()},
                "placement": s.describe()}
    return res
