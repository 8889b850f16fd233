"""(b) 4096 paged writes of 16 KiB at random indices vs one contiguous write of 64 MiB.

Daemon A writes to daemon B on loopback (one rail, placed as in
:mod:`benchmarks.engine_common`), from a client in this process:

- ``contiguous`` (the baseline): ``submit_single_write(64 MiB, imm, ...)``;
- ``paged``: one ``submit_paged_writes(16 KiB, imm, (src, Pages(src_idx, 16 KiB)),
  (dst, Pages(dst_idx, 16 KiB)))`` with 4096 pages, both index lists a fresh random
  permutation of 0..4095 for every write (every page of both regions is used,
  in random order), the receiver's ImmCounter reaching 4096.

The floor, for context: the same two shapes through plain Python sockets
(:mod:`benchmarks.engine_peers`: one ``sendall`` of 64 MiB, against
``sendmsg`` / ``recvmsg_into`` over the same 4096 pages in random orders on
both sides), to show what scattering 16 KiB pages costs on this machine
before any engine is involved.

Each timed transferd write runs from the submit to both the initiator's completion and
the receiver's ``expect_imm_count`` (1 for the single write, 4096 for the
pages; registered before the clock starts).
Rounds alternate the arms, ``reps`` writes per arm per round; the ratio
(paged throughput / contiguous throughput) is taken per round, and the median
over rounds reported.  Target: at least 0.8x.  Afterwards one more paged write
is checked page by page (CRC-32 of each of the 4096 destination pages against
its source page).
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from typing import Any

from .engine_common import (
    SECTION,
    PeerPair,
    client_on,
    fill_remote,
    pair_and_floor,
    sides,
)
from .harness import (
    BenchResult,
    Check,
    Options,
    Table,
    fmt_ratio,
    median,
    quiet_gc,
)

NAME = "engine_paged"
TITLE = "(b) 4096 paged writes of 16 KiB at random indices vs one contiguous 64 MiB write"
SECTION = SECTION

PAGE = 16 * 1024
PAGES = 4096
SIZE = PAGE * PAGES
TARGET = 0.8
TIMEOUT = 60.0


async def _measure(opts: Options, a_url: str, b_url: str, sock: PeerPair | None
                   ) -> dict[str, Any]:
    from client import Client, Pages

    rounds = opts.pick(7, 3)
    reps = opts.pick(5, 3)
    rng = random.Random(20240601)
    ca = await Client.connect(a_url)
    cb = await Client.connect(b_url)
    try:
        src = await ca.alloc_buffer(SIZE)
        dst = await cb.alloc_buffer(SIZE)
        await fill_remote(ca, src, SIZE)
        await cb.buffer_clear(dst, 0)
        mr, _ = await ca.reg_mr(src)
        _, desc = await cb.reg_mr(dst)
        imm = rng.randrange(1 << 20, 1 << 30)

        async def contiguous() -> float:
            seen = await cb.expect_imm_count(imm, 1, wait=False)
            t0 = time.perf_counter()
            done = await ca.submit_single_write(SIZE, imm, (mr, 0), (desc, 0))
            await asyncio.wait_for(asyncio.gather(done.wait(), seen.wait()), TIMEOUT)
            return time.perf_counter() - t0

        async def paged(src_idx: list[int] | None = None,
                        dst_idx: list[int] | None = None) -> float:
            sp = Pages(src_idx or rng.sample(range(PAGES), PAGES), PAGE)
            dp = Pages(dst_idx or rng.sample(range(PAGES), PAGES), PAGE)
            seen = await cb.expect_imm_count(imm + 1, PAGES, wait=False)
            t0 = time.perf_counter()
            done = await ca.submit_paged_writes(PAGE, imm + 1, (mr, sp), (desc, dp))
            await asyncio.wait_for(asyncio.gather(done.wait(), seen.wait()), TIMEOUT)
            return time.perf_counter() - t0

        arms: dict[str, Any] = {"contiguous": contiguous, "paged": paged}
        if sock is not None:
            seeds = iter(range(1 << 30))

            async def sock_contiguous() -> float:
                return sock.bulk(SIZE)

            async def sock_paged() -> float:
                c = sock.initiator.cmd(op="paged", size=SIZE, page=PAGE, seed=next(seeds))
                return float(c["s"])

            arms["socket contiguous"] = sock_contiguous
            arms["socket paged"] = sock_paged
        for fn in arms.values():  # warm: links open, pages touched
            await fn()
        per_round: dict[str, list[float]] = {k: [] for k in arms}
        for r in range(rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for name in order:
                with quiet_gc():
                    xs = [await arms[name]() for _ in range(reps)]
                per_round[name].append(median(xs))
                opts.log(f"round {r} {name}: {median(xs) * 1e3:.1f} ms")

        # Check one paged write page by page.
        si = rng.sample(range(PAGES), PAGES)
        di = rng.sample(range(PAGES), PAGES)
        await cb.buffer_clear(dst, 0)
        await paged(si, di)
        want = await ca.get_tensor(src.tensor())
        got = await cb.get_tensor(dst.tensor())
        def page(buf: Any, k: int) -> int:
            return zlib.crc32(buf[k * PAGE : (k + 1) * PAGE])

        bad = [(i, j) for i, j in zip(si, di, strict=True) if page(got, j) != page(want, i)]
        if bad:
            raise AssertionError(f"{len(bad)} pages differ after a paged write, e.g. {bad[:3]}")
    finally:
        await ca.close()
        await cb.close()
    return {"rounds": rounds, "reps": reps, "per_round": per_round}


def run(opts: Options) -> BenchResult:
    import uvloop

    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    with pair_and_floor(s, SIZE, res.notes) as (a, b, sock), client_on(s.initiator):
        m = uvloop.run(_measure(opts, a.url, b.url, sock))
    pr = m["per_round"]

    def ratio_of(contig: str, paged: str) -> float:
        return median([c / p for c, p in zip(pr[contig], pr[paged], strict=True)])

    ratio = ratio_of("contiguous", "paged")
    floor = ratio_of("socket contiguous", "socket paged") if sock is not None else float("nan")
    table = Table(
        f"64 MiB on loopback, {m['rounds']} alternating rounds x {m['reps']} writes per arm "
        "(median of round medians; ratio per round, then the median)",
        ["arm", "ms", "GiB/s", "paged / contiguous", "target"],
    )
    pages = f"{PAGES} x {PAGE // 1024} KiB"
    rows = [("transferd contiguous", "contiguous", "", ""),
            (f"transferd paged ({pages})", "paged", fmt_ratio(ratio), f">= {TARGET}x")]
    if sock is not None:
        rows += [("plain socket contiguous", "socket contiguous", "", ""),
                 (f"plain socket paged ({pages})", "socket paged", fmt_ratio(floor),
                  "(the floor)")]
    for label, name, r, target in rows:
        t = median(pr[name])
        table.add(label, f"{t * 1e3:.1f}", f"{SIZE / t / 2**30:.2f}", r, target)
    res.tables.append(table)
    res.checks.append(Check("(b) 4096 x 16 KiB paged / 64 MiB contiguous", ratio, ">=", TARGET,
                            "x"))
    if sock is not None:
        res.notes.append(
            f"the same pages through plain Python sockets (sendmsg / recvmsg_into over random "
            f"page lists, 512 views a call) reach {floor:.2f}x of their own contiguous write: "
            f"transferd's paged/contiguous is {ratio / floor:.2f} of that floor")
    res.notes.append(f"placement: {s.describe()}")
    res.notes.append(
        "each write timed from submit to both the initiator's completion and the receiver's "
        "expect_imm_count (1 for the single write, 4096 for the pages); source and destination "
        "indices are fresh random permutations per write; one paged write checked page by page")
    res.data = {"page": PAGE, "pages": PAGES, "ratio": ratio, "socket_ratio": floor, **m}
    return res
