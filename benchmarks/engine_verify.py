"""(v) What checksums cost: a 1 GiB and a 4 KiB write with ``verify=True`` and without.

One pair of daemons (placed as every engine figure, :mod:`benchmarks.engine_common`),
one client; in alternating rounds:

- ``1 GiB``: one single write of 1 GiB A -> B, timed from the submit to its completion,
  ``verify=False`` and ``verify=True`` (a CRC32C taken from the source by A, one
  computed over the placed bytes by B before it acknowledges);
- ``4 KiB``: ``n`` sequential 4 KiB writes, the latency of each (submit to
  completion), ``verify=False`` and ``verify=True``; the p50 of each round.

Targets (issue 20): 1 GiB with verify at least 0.85x the rate without; 4 KiB p50 with
verify at most 1.1x the one without.  After the rounds B's bytes are checked against A's.
"""

from __future__ import annotations

import asyncio
import time

from .engine_common import (
    SECTION,
    GiB,
    MiB,
    TransferdArm,
    client_on,
    fill_remote,
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
TITLE = "(v) checksums: 1 GiB and 4 KiB writes with verify and without"
SECTION = SECTION

SMALL = 4096
TIMEOUT = 120.0


class _Arm(TransferdArm):
    async def fill(self) -> None:
        await fill_remote(self.ca, self.src, self.size)
        await super().fill()

    async def _bulk(self, size: int, verify: bool) -> float:
        t0 = time.perf_counter()
        c = await self.ca.submit_single_write(size, None, (self.mr, 0), (self.desc, 0),
                                              verify=verify)
        await asyncio.wait_for(c, TIMEOUT)
        return time.perf_counter() - t0

    async def _small(self, n: int, verify: bool) -> list[float]:
        submit = self.ca.submit_single_write
        src, dst = (self.mr, 0), (self.desc, 0)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await (await submit(SMALL, None, src, dst, verify=verify))
            out.append(time.perf_counter() - t0)
        return out

    def bulk(self, size: int, verify: bool) -> float:
        return float(self.loop.run_until_complete(self._bulk(size, verify)))

    def small(self, n: int, verify: bool) -> list[float]:
        return list(self.loop.run_until_complete(self._small(n, verify)))

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
    bulk: dict[bool, list[float]] = {False: [], True: []}
    small: dict[bool, list[float]] = {False: [], True: []}
    try:
        with client_on(s.initiator):
            arm = _Arm(a.url, b.url, size)
            arm.setup()
            for v in (False, True):  # untimed: links up, pages touched
                arm.bulk(size, v)
                arm.small(200, v)
            arms = [("bulk", False), ("bulk", True), ("small", False), ("small", True)]
            for r, (kind, v) in interleave(arms, rounds):
                with quiet_gc():
                    if kind == "bulk":
                        bulk[v].append(arm.bulk(size, v))
                        opts.log(f"round {r} 1 GiB verify={v}: {size / bulk[v][-1] / GiB:.2f}"
                                 " GiB/s")
                    else:
                        small[v].append(percentile(arm.small(n, v), 50))
            ok = arm.check(size)
    finally:
        if arm is not None:
            arm.close()
        b.stop()
        a.stop()
    if not ok:
        raise AssertionError("B's bytes differ from A's after the rounds")
    bulk_ratio = median([off / on for off, on in zip(bulk[False], bulk[True], strict=True)])
    small_ratio = median([on / off for off, on in zip(small[False], small[True], strict=True)])
    what = f"{size / GiB:g} GiB" if size >= GiB else f"{size // MiB} MiB"
    t = Table(f"{rounds} alternating rounds per arm, one rail on loopback (median over rounds; "
              "ratios per round, then the median)",
              ["write", "verify=False", "verify=True", "ratio", "target"])
    t.add(f"{what}: GiB/s", f"{size / median(bulk[False]) / GiB:.2f}",
          f"{size / median(bulk[True]) / GiB:.2f}", fmt_ratio(bulk_ratio), ">= 0.85x")
    t.add(f"4 KiB: p50 us ({n} sequential)", f"{median(small[False]) * 1e6:.1f}",
          f"{median(small[True]) * 1e6:.1f}", fmt_ratio(small_ratio), "<= 1.1x")
    res.tables.append(t)
    res.checks.append(Check(f"(v) {what} write rate, verify / without", bulk_ratio, ">=", 0.85,
                            "x"))
    res.checks.append(Check("(v) 4 KiB write p50, verify / without", small_ratio, "<=", 1.1,
                            "x"))
    res.notes.append(f"placement: {s.describe()}")
    res.data = {"bulk": {str(k): v for k, v in bulk.items()},
                "small_p50": {str(k): v for k, v in small.items()},
                "bulk_ratio": bulk_ratio, "small_ratio": small_ratio, "size": size, "n": n}
    return res
