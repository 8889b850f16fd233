"""(v) What checksums cost: a 1 GiB and a 4 KiB write, and read, with ``verify=True``
and without.

One pair of daemons (placed as every engine figure, :mod:`benchmarks.engine_common`),
one client; in alternating rounds:

- ``1 GiB``: one single write of 1 GiB A -> B, timed from the submit to its completion,
  ``verify=False`` and ``verify=True`` (a CRC32C taken from the source by A, one
  computed over the placed bytes by B before it acknowledges);
- ``4 KiB``: ``n`` sequential 4 KiB writes, the latency of each (submit to
  completion), ``verify=False`` and ``verify=True``; the p50 of each round.

- the same two for one-sided reads B -> A, into the region A writes from (B's is
  registered ``"rw"``): ``verify=True`` has B take the CRC32C of the bytes it answers
  with from its region and A take its own as they are placed.

Targets (issue 20): 1 GiB with verify at least 0.85x the rate without; 4 KiB p50 with
verify at most 1.1x the one without; the same for reads.  After the rounds B's bytes
are checked against A's (a write and a read of the same range keep them equal).
"""

from __future__ import annotations

import asyncio
import time

from .engine_common import (
    SECTION,
    FilledArm,
    GiB,
    MiB,
    client_on,
    sides,
    start_pair,
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

NAME = "engine_verify"
TITLE = "(v) checksums: 1 GiB and 4 KiB writes and reads with verify and without"
SECTION = SECTION

SMALL = 4096
TIMEOUT = 120.0


class _Arm(FilledArm):
    # Readable too: the read arms pull B's bytes back into A's region.
    access = "rw"

    async def _bulk(self, size: int, verify: bool, read: bool) -> float:
        t0 = time.perf_counter()
        if read:
            c = await self.ca.submit_single_read(size, (self.mr, 0), (self.desc, 0),
                                                 verify=verify)
        else:
            c = await self.ca.submit_single_write(size, None, (self.mr, 0), (self.desc, 0),
                                                  verify=verify)
        await asyncio.wait_for(c, TIMEOUT)
        return time.perf_counter() - t0

    async def _small(self, n: int, verify: bool, read: bool) -> list[float]:
        src, dst = (self.mr, 0), (self.desc, 0)
        out = []
        if read:
            get = self.ca.submit_single_read
            for _ in range(n):
                t0 = time.perf_counter()
                await (await get(SMALL, src, dst, verify=verify))
                out.append(time.perf_counter() - t0)
            return out
        submit = self.ca.submit_single_write
        for _ in range(n):
            t0 = time.perf_counter()
            await (await submit(SMALL, None, src, dst, verify=verify))
            out.append(time.perf_counter() - t0)
        return out

    def bulk(self, size: int, verify: bool, read: bool = False) -> float:
        return float(self.loop.run_until_complete(self._bulk(size, verify, read)))

    def small(self, n: int, verify: bool, read: bool = False) -> list[float]:
        return list(self.loop.run_until_complete(self._small(n, verify, read)))

    def check(self, size: int) -> bool:
        async def check() -> bool:
            step = 64 * MiB
            for off in range(0, size, step):
                k = min(step, size - off)
                got = await self.cb.get_tensor(self.dst.tensor(off, k))
                want = await self.ca.get_tensor(self.src.tensor(off, k))
                if bytes(got) != bytes(want):
                    return False
            return True

        return bool(self.loop.run_until_complete(check()))


def run(opts: Options) -> BenchResult:
    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    size = opts.pick(GiB, 256 * MiB)
    rounds = opts.pick(6, 2)
    n = opts.pick(2000, 400)
    a, b = start_pair(s)
    arm = None
    # By (read, verify): the writes' and the reads' rounds.
    bulk: dict[tuple[bool, bool], list[float]] = {(r, v): [] for r in (False, True)
                                                  for v in (False, True)}
    small: dict[tuple[bool, bool], list[float]] = {k: [] for k in bulk}
    try:
        with client_on(s.initiator):
            arm = _Arm(a.url, b.url, size)
            arm.setup()
            for rd, v in bulk:  # untimed: links up, pages touched
                arm.bulk(size, v, rd)
                arm.small(200, v, rd)
            arms = [(kind, k) for kind in ("bulk", "small") for k in bulk]
            for r, (kind, (rd, v)) in interleave(arms, rounds):
                with quiet_gc():
                    if kind == "bulk":
                        bulk[rd, v].append(arm.bulk(size, v, rd))
                        opts.log(f"round {r} {'read' if rd else 'write'} verify={v}: "
                                 f"{size / bulk[rd, v][-1] / GiB:.2f} GiB/s")
                    else:
                        small[rd, v].append(percentile(arm.small(n, v, rd), 50))
            ok = arm.check(size)
    finally:
        if arm is not None:
            arm.close()
        b.stop()
        a.stop()
    if not ok:
        raise AssertionError("B's bytes differ from A's after the rounds")
    what = f"{size / GiB:g} GiB" if size >= GiB else f"{size // MiB} MiB"
    t = Table(f"{rounds} alternating rounds per arm, one rail on loopback (median over rounds; "
              "ratios per round, then the median)",
              ["op", "verify=False", "verify=True", "ratio", "target"])
    ratios: dict[str, float] = {}
    for rd in (False, True):
        op = "read" if rd else "write"
        off, on = bulk[rd, False], bulk[rd, True]
        ratios[f"{op}_bulk"] = bulk_ratio = median(
            [a / b for a, b in zip(off, on, strict=True)])
        off, on = small[rd, False], small[rd, True]
        ratios[f"{op}_small"] = small_ratio = median(
            [b / a for a, b in zip(off, on, strict=True)])
        t.add(f"{what} {op}: GiB/s", f"{size / median(bulk[rd, False]) / GiB:.2f}",
              f"{size / median(bulk[rd, True]) / GiB:.2f}", fmt_ratio(bulk_ratio), ">= 0.85x")
        t.add(f"4 KiB {op}: p50 us ({n} sequential)", f"{median(small[rd, False]) * 1e6:.1f}",
              f"{median(small[rd, True]) * 1e6:.1f}", fmt_ratio(small_ratio), "<= 1.1x")
        res.checks.append(Check(f"(v) {what} {op} rate, verify / without", bulk_ratio, ">=",
                                0.85, "x"))
        res.checks.append(Check(f"(v) 4 KiB {op} p50, verify / without", small_ratio, "<=",
                                1.1, "x"))
    res.tables.append(t)
    res.notes.append(f"placement: {s.describe()}")
    # (Keys "False"/"True" are the writes', as before reads were measured here.)
    res.data = {"bulk": {("read " if rd else "") + str(v): x for (rd, v), x in bulk.items()},
                "small_p50": {("read " if rd else "") + str(v): x
                              for (rd, v), x in small.items()},
                "bulk_ratio": ratios["write_bulk"], "small_ratio": ratios["write_small"],
                "read_bulk_ratio": ratios["read_bulk"],
                "read_small_ratio": ratios["read_small"], "size": size, "n": n}
    return res
