"""One-sided READ against WRITE (issue 19), the same daemon pair, the same run.

Daemons A and B (``rpc-server``, one rail each on loopback), placed as every engine
figure's (:mod:`benchmarks.engine_common`); a client of each in this process.  B's
region is registered ``access="rw"``; A's region is the source of A's writes and the
destination of A's reads, so both move the same bytes over the same link, in opposite
directions, timed in the client from the submit to the completion EVENT:

- **1 GiB**: ``submit_single_write(1 GiB)`` A -> B against ``submit_single_read(1 GiB)``
  B -> A, alternating rounds; target read / write >= 0.95x (median of per-round ratios).
- **4 KiB**: sequential 4 KiB writes against 4 KiB reads, p50 of each; target
  read p50 / write p50 <= 1.1x.
- **paged 4096 x 16 KiB**: ``submit_paged_writes`` against ``submit_paged_reads`` of the
  same 4096 pages (64 MiB) scattered over the region; target >= 0.95x.  One op is 20-60
  ms here, so one slow round moves a 7-round median a lot: the paged figure has rounds
  of its own (51), each a write and a read next to each other (ABBA order), and its
  ratio is the median of those paired per-round ratios, with its 95% confidence
  interval (order statistics: no assumption on the distribution), and the ratio of the
  two medians beside it.
- **NIXL READ** (UCX over tcp, where the benchmark venv has it): one posted READ of
  1 GiB and its WRITE, beside transferd's, for scale (no target).

After the rounds, B's region (written) and A's (read back) are checked by CRC-32 against
what each must hold.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from typing import Any

from .engine_common import (
    SECTION,
    FilledArm,
    GiB,
    MiB,
    PeerPair,
    PeerUnavailable,
    client_on,
    crc_remote,
    only_running,
    sides,
    start_arms,
)
from .harness import (
    BenchResult,
    Check,
    Options,
    Table,
    fmt_ratio,
    interleave,
    median,
    percentile,
    quiet_gc,
)

NAME = "engine_reads"
TITLE = "one-sided READ vs WRITE: 1 GiB, 4 KiB p50, paged 4096 x 16 KiB; NIXL READ beside"
SECTION = SECTION

SIZE = GiB
QUICK_SIZE = 256 * MiB
PAGE = 16 * 1024
PAGES = 4096
TIMEOUT = 120.0
TARGET_BULK = 0.95
TARGET_SMALL = 1.1
TARGET_PAGED = 0.95
PAGED_ROUNDS = 51
QUICK_PAGED_ROUNDS = 9


def median_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """The distribution-free confidence interval of the median of ``values``: the
    order statistics ``k`` and ``n + 1 - k`` with the largest ``k`` for which
    P(Binomial(n, 1/2) < k) <= (1 - level) / 2 (nan, nan with too few values)."""
    n = len(values)
    xs = sorted(values)
    tail, k, below = (1 - level) / 2, 0, 0.0
    while k < n // 2:
        below += math.comb(n, k) / 2 ** n  # P(X = k) added: P(X <= k)
        if below > tail:
            break
        k += 1
    if k == 0:
        return math.nan, math.nan
    return xs[k - 1], xs[n - k]


class _Transferd(FilledArm):
    """A's ``src`` (region ``mr``) and B's ``dst`` (``desc``, readable): writes go
    A -> B, reads B -> A, into the same region A writes from."""

    access = "rw"

    async def _setup(self) -> None:
        await super()._setup()
        rng = random.Random(19)
        n = min(PAGES, self.size // PAGE)
        from client import Pages
        # The same pages on both sides: a write and a read of them keep A and B equal
        # (what the CRCs check after the rounds), scattered over the region.
        self.pages_a = self.pages_b = Pages(rng.sample(range(self.size // PAGE), n), PAGE)

    async def _bulk(self, op: str, size: int) -> float:
        t0 = time.perf_counter()
        if op == "write":
            c = await self.ca.submit_single_write(size, None, (self.mr, 0), (self.desc, 0))
        else:
            c = await self.ca.submit_single_read(size, (self.mr, 0), (self.desc, 0))
        await asyncio.wait_for(c, TIMEOUT)
        return time.perf_counter() - t0

    async def _paged(self, op: str) -> float:
        t0 = time.perf_counter()
        if op == "write":
            c = await self.ca.submit_paged_writes(PAGE, None, (self.mr, self.pages_a),
                                                  (self.desc, self.pages_b))
        else:
            c = await self.ca.submit_paged_reads(PAGE, (self.mr, self.pages_a),
                                                 (self.desc, self.pages_b))
        await asyncio.wait_for(c, TIMEOUT)
        return time.perf_counter() - t0

    async def _lat(self, op: str, n: int) -> list[float]:
        clock = time.perf_counter
        src, dst = (self.mr, 0), (self.desc, 0)
        write, read = self.ca.submit_single_write, self.ca.submit_single_read
        out = []
        for _ in range(n):
            t0 = clock()
            if op == "write":
                await (await write(4096, None, src, dst))
            else:
                await (await read(4096, src, dst))
            out.append(clock() - t0)
        return out

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def crcs(self, size: int) -> tuple[int, int]:
        return (self.run(crc_remote(self.ca, self.src, size)),
                self.run(crc_remote(self.cb, self.dst, size)))


def run(opts: Options) -> BenchResult:
    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    size = opts.pick(SIZE, QUICK_SIZE)
    rounds = opts.pick(7, 3)
    paged_rounds = opts.pick(PAGED_ROUNDS, QUICK_PAGED_ROUNDS)
    lat_n = opts.pick(2000, 300)
    nixl: dict[str, PeerPair] = {}
    nixl_missing = ""
    with start_arms(s, lambda a, b: _Transferd(a, b, size), (), size, opts.log) as started:
        td = started.transferd
        for xfer in ("WRITE", "READ"):
            try:
                nixl[xfer] = PeerPair("nixl", size, s, extra=["--xfer", xfer])
            except PeerUnavailable as exc:
                nixl_missing = str(exc)
                break
        try:
            bulk: dict[str, list[float]] = {"write": [], "read": []}
            paged: dict[str, list[float]] = {"write": [], "read": []}
            lat: dict[str, list[float]] = {"write": [], "read": []}
            nixl_t: dict[str, list[float]] = {x: [] for x in nixl}
            with client_on(s.initiator):
                for op in ("write", "read"):  # untimed: links, pages touched
                    td.run(td._bulk(op, size))
                    td.run(td._paged(op))
                    td.run(td._lat(op, 50))
                for pair in nixl.values():
                    only_running(nixl.values(), pair)
                    pair.bulk(size)
                only_running(nixl.values())  # transferd's rounds run with NIXL stopped
                for r, op in interleave(["write", "read"], rounds):
                    with quiet_gc():
                        dt = td.run(td._bulk(op, size))
                        bulk[op].append(dt)
                        lat[op] += td.run(td._lat(op, lat_n // rounds))
                    opts.log(f"round {r} {op}: {size / dt / GiB:.2f} GiB/s")
                # Paged: a write and a read side by side each round (paired ratios).
                for _, op in interleave(["write", "read"], paged_rounds):
                    with quiet_gc():
                        paged[op].append(td.run(td._paged(op)))
                opts.log("paged ms: write " + " ".join(f"{x * 1e3:.1f}" for x in paged["write"])
                         + "; read " + " ".join(f"{x * 1e3:.1f}" for x in paged["read"]))
                for _, x in interleave(list(nixl), rounds):
                    only_running(nixl.values(), nixl[x])
                    nixl_t[x].append(nixl[x].bulk(size))
                # The last op of the last round decides what both regions hold now:
                # whichever it was, A's and B's are equal (B got A's bytes, or A B's).
                crc_a, crc_b = td.crcs(size)
        finally:
            for pair in nixl.values():
                pair.stop()
    if crc_a != crc_b or crc_a != td.source_crc:
        raise AssertionError(f"regions differ after the rounds: A {crc_a:08x}, B {crc_b:08x}, "
                             f"source {td.source_crc:08x}")
    bulk_ratio = median([w / r for w, r in zip(bulk["write"], bulk["read"], strict=True)])
    paged_rounds_ratios = [w / r for w, r in zip(paged["write"], paged["read"], strict=True)]
    paged_ratio = median(paged_rounds_ratios)
    paged_lo, paged_hi = median_ci(paged_rounds_ratios)
    paged_of_medians = median(paged["write"]) / median(paged["read"])
    p50 = {op: percentile(v, 50) for op, v in lat.items()}
    small_ratio = p50["read"] / p50["write"]
    what = f"{size / GiB:g} GiB" if size >= GiB else f"{size // MiB} MiB"
    t = Table(f"transferd READ vs WRITE on loopback, {rounds} alternating rounds, paged "
              f"{paged_rounds} (medians; ratio = read rate / write rate, or read p50 / "
              "write p50; paged: median of per-round ratios [its 95% CI])",
              ["figure", "write", "read", "read vs write", "target"])
    t.add(f"{what} single (GiB/s)", f"{size / median(bulk['write']) / GiB:.2f}",
          f"{size / median(bulk['read']) / GiB:.2f}", fmt_ratio(bulk_ratio),
          f">= {TARGET_BULK}x")
    t.add("4 KiB single, p50 (us)", f"{p50['write'] * 1e6:.0f}", f"{p50['read'] * 1e6:.0f}",
          fmt_ratio(small_ratio), f"<= {TARGET_SMALL}x (read p50 / write p50)")
    nbytes = len(td.pages_a.indices) * PAGE
    t.add(f"paged {len(td.pages_a.indices)} x 16 KiB (GiB/s)",
          f"{nbytes / median(paged['write']) / GiB:.2f}",
          f"{nbytes / median(paged['read']) / GiB:.2f}",
          f"{fmt_ratio(paged_ratio)} [{paged_lo:.2f}, {paged_hi:.2f}], of medians "
          f"{paged_of_medians:.2f}x", f">= {TARGET_PAGED}x (median of per-round)")
    if nixl_t:
        t.add(f"NIXL (UCX tcp) {what} (GiB/s)",
              f"{size / median(nixl_t['WRITE']) / GiB:.2f}" if nixl_t.get("WRITE") else "-",
              f"{size / median(nixl_t['READ']) / GiB:.2f}" if nixl_t.get("READ") else "-",
              fmt_ratio(median(nixl_t["WRITE"]) / median(nixl_t["READ"]))
              if nixl_t.get("WRITE") and nixl_t.get("READ") else "-", "(beside, no target)")
    else:
        t.add("NIXL (UCX tcp)", "-", "-", "-", f"not available: {nixl_missing}")
    res.tables.append(t)
    res.checks.append(Check(f"{what} read / write", bulk_ratio, ">=", TARGET_BULK, "x"))
    res.checks.append(Check("4 KiB read p50 / write p50", small_ratio, "<=", TARGET_SMALL, "x"))
    res.checks.append(Check("paged 4096 x 16 KiB read / write", paged_ratio, ">=",
                            TARGET_PAGED, "x"))
    res.notes.append(f"placement: {s.describe()}")
    res.notes.append("CRC-32 of both regions checked after the rounds; NIXL arm's bytes "
                     "not checked (timing beside, for scale)")
    res.data = {"size": size, "rounds": rounds, "bulk": bulk, "paged": paged,
                "paged_rounds": paged_rounds, "p50": p50, "nixl": nixl_t,
                "ratios": {"bulk": bulk_ratio, "small": small_ratio, "paged": paged_ratio,
                           "paged_ci95": [paged_lo, paged_hi],
                           "paged_of_medians": paged_of_medians,
                           "bulk_of_medians": median(bulk["write"]) / median(bulk["read"])}}
    return res
