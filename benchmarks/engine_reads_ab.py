"""The paged read / write figure of :mod:`.engine_reads`, this tree against another
(``BASE``: a checkout, e.g. ``git worktree add /tmp/base main``), in one run.

Two daemon pairs, this tree's and the base's (its code first on ``PYTHONPATH``), placed
as :mod:`.engine_reads` places its pair; every round a paged write and a paged read of
4096 x 16 KiB on each pair, the four in alternating order, and the CPU time each daemon
spent on each op (``/proc`` schedstat).  Per tree: the medians, the median of the paired
per-round ratios (read rate / write rate) with its 95% confidence interval, the ratio
of the medians, and the CPU per op of A and B::

    python -m benchmarks.engine_reads_ab /tmp/base 40

Not a registered benchmark (it needs a second tree): a tool for a change's before and
after (docs/benchmarks.md, issue 19).
"""

from __future__ import annotations

import statistics
import sys

from .engine_common import MiB, client_on, sides, start_pair
from .engine_reads import _Transferd, median_ci
from .harness import Options, Pinning, quiet_gc
from .scale_common import cpu_seconds

OPS = ("write", "read")


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m benchmarks.engine_reads_ab BASE_TREE [ROUNDS]")
    base, rounds = argv[0], int(argv[1]) if len(argv) > 1 else 40
    s = sides(Options(pinning=Pinning.detect(enabled=True)))
    pairs = {"base": start_pair(s, env={"PYTHONPATH": base})}
    try:
        pairs["this"] = start_pair(s)
        arms: dict[str, _Transferd] = {}
        with client_on(s.initiator):
            for k, (a, b) in pairs.items():
                arm = _Transferd(a.url, b.url, 256 * MiB)
                arm.setup()
                for op in OPS * 2:  # untimed: links, pages touched
                    arm.run(arm._paged(op))
                arms[k] = arm
            t: dict[tuple[str, str], list[float]] = {(k, op): [] for k in arms for op in OPS}
            cpu: dict[tuple[str, str], list[list[float]]] = {key: [] for key in t}
            order = list(t)
            for r in range(rounds):
                for k, op in (order if r % 2 == 0 else order[::-1]):
                    c0 = [cpu_seconds(p.pid) for p in pairs[k]]
                    with quiet_gc():
                        t[(k, op)].append(arms[k].run(arms[k]._paged(op)))
                    cpu[(k, op)].append([cpu_seconds(p.pid) - c
                                         for p, c in zip(pairs[k], c0, strict=True)])
            for arm in arms.values():
                arm.close()
        for k in arms:
            w, rd = t[(k, "write")], t[(k, "read")]
            per = [x / y for x, y in zip(w, rd, strict=True)]
            lo, hi = median_ci(per)
            print(f"{k}: write {statistics.median(w) * 1e3:.2f} ms (min {min(w) * 1e3:.2f}), "
                  f"read {statistics.median(rd) * 1e3:.2f} ms (min {min(rd) * 1e3:.2f}); "
                  f"read / write: median per-round {statistics.median(per):.3f} "
                  f"[{lo:.3f}, {hi:.3f}], of medians "
                  f"{statistics.median(w) / statistics.median(rd):.3f}")
            for op in OPS:
                c = cpu[(k, op)]
                print(f"  CPU per {op}: A {statistics.median(x[0] for x in c) * 1e3:.1f} ms, "
                      f"B {statistics.median(x[1] for x in c) * 1e3:.1f} ms")
    finally:
        for a, b in pairs.values():
            b.stop()
            a.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
