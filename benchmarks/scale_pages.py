"""(2) Pages: paged write time per page, 256 to 65,536 pages of 4 KiB and 64 KiB.

Daemon A writes to daemon B on loopback (one rail; placed as every engine figure,
:mod:`benchmarks.engine_common`), from a client in this process:
``submit_paged_writes(page, None, (src, Pages(si, page)), (dst, Pages(di, page)))``
with ``P`` pages, timed from the submit to the completion (B acknowledges each part
once its bytes are in place).  The floor, in the same rounds: the same pages through
plain Python sockets (:mod:`benchmarks.engine_peers`' ``paged``: ``sendmsg`` /
``recvmsg_into`` over page lists in random orders on both sides).

Memory: 65,536 pages of 64 KiB are 4 GiB a side, more than this shared machine can
give a benchmark.  Both sides' regions are therefore at most ``REGION`` (256 MiB:
65,536 pages of 4 KiB fit whole, 4,096 of 64 KiB), and a write of more pages than
the region holds visits it cyclically: the index lists are fresh random permutations
of the region's pages, one after another, until there are ``P`` (every page is still
a page of its own in the request, its own iovec and its own receive; only its memory
is reused, and a 256 MiB region is far past any cache).  The floor does the same
passes over the same region size.

Reported: microseconds per page for each ``P`` and page size, both arms, wall time
(submit to completion) and CPU time (both sides' processes, all threads, from
``schedstat``: the work per page, which other processes on a shared machine do not
inflate), the flatness ratio (the largest per-page time over the smallest, per arm and
page size) and the worst growth (the largest ratio of a per-page time to the smallest at
fewer pages: a write's fixed cost spread over 256 pages is not growth).  The target is
on the growth of the CPU time per page: at most ``FLAT``.
"""

from __future__ import annotations

import random
import time
from typing import Any

from .engine_common import PeerPair, client_on, pair_and_floor, sides
from .harness import BenchResult, Check, Options, Table, fmt_ratio, median, quiet_gc
from .scale_common import SECTION, cpu_seconds

NAME = "scale_pages"
TITLE = "(2) paged write time per page, 256..65,536 pages of 4 KiB and 64 KiB vs plain sockets"
SECTION = SECTION

PAGES = (256, 1024, 4096, 16384, 65536)
PAGE_SIZES = (4096, 65536)
REGION = 256 << 20
TIMEOUT = 120.0
# Flat: the largest per-page time at most this many times the smallest.
FLAT = 1.5


def worst_growth(xs: list[float]) -> float:
    """The largest ``xs[j] / min(xs[:j])``: how much a per-page cost grew from any smaller
    page count to a larger one (1.0 when it never grew)."""
    worst, low = 1.0, xs[0] if xs else 1.0
    for x in xs[1:]:
        worst = max(worst, x / low)
        low = min(low, x)
    return worst


def _indices(rng: random.Random, pages: int, region_pages: int) -> list[int]:
    out: list[int] = []
    while len(out) < pages:
        out += rng.sample(range(region_pages), min(region_pages, pages - len(out)))
    return out


async def _measure(opts: Options, a_url: str, b_url: str, sock: PeerPair | None,
                   pages: tuple[int, ...], page_sizes: tuple[int, ...], region: int,
                   pids: dict[str, list[int]]) -> dict[str, Any]:
    from client import Client, Pages

    rounds = opts.pick(3, 2)
    rng = random.Random(20261201)
    ca = await Client.connect(a_url)
    cb = await Client.connect(b_url)
    per: dict[str, dict[str, list[float]]] = {}  # "page/P" -> arm -> per-page seconds
    cpu: dict[str, dict[str, list[float]]] = {}  # the same, CPU seconds of both sides
    try:
        src = await ca.alloc_buffer(region)
        dst = await cb.alloc_buffer(region)
        await ca.buffer_clear(src, 0x3C)
        await cb.buffer_clear(dst, 0)
        mr, _ = await ca.reg_mr(src)
        _, desc = await cb.reg_mr(dst)

        async def paged(page: int, n: int, si: list[int] | None = None,
                        di: list[int] | None = None) -> float:
            held = region // page
            sp = Pages(si or _indices(rng, n, held), page)
            dp = Pages(di or _indices(rng, n, held), page)
            t0 = time.perf_counter()
            done = await ca.submit_paged_writes(page, None, (mr, sp), (desc, dp))
            await done.wait(TIMEOUT)
            return time.perf_counter() - t0

        seeds = iter(range(1 << 30))

        def sock_paged(page: int, n: int) -> float:
            assert sock is not None
            held = region // page
            total = 0.0
            left = n
            while left > 0:  # whole passes over the region, then the rest
                k = min(left, held)
                total += float(sock.initiator.cmd(op="paged", size=k * page, page=page,
                                                  seed=next(seeds), timeout=TIMEOUT)["s"])
                left -= k
            return total

        for page in page_sizes:  # warm both arms: links open, every page touched
            await paged(page, region // page)
            if sock is not None:
                sock_paged(page, region // page)
        for r in range(rounds):
            for page in page_sizes:
                for n in pages:
                    key = f"{page}/{n}"
                    slot = per.setdefault(key, {"transferd": [], "plain socket": []})
                    cslot = cpu.setdefault(key, {"transferd": [], "plain socket": []})
                    reps = max(1, opts.pick(16 << 20, 8 << 20) // (n * page))
                    order = ["transferd", "plain socket"]
                    if (r + n) % 2:
                        order.reverse()
                    for arm in order:
                        if arm == "plain socket" and sock is None:
                            continue
                        c0 = sum(map(cpu_seconds, pids[arm]))
                        with quiet_gc():
                            if arm == "transferd":
                                xs = [await paged(page, n) for _ in range(reps)]
                            else:
                                xs = [sock_paged(page, n) for _ in range(reps)]
                        slot[arm].append(median(xs) / n)
                        cslot[arm].append((sum(map(cpu_seconds, pids[arm])) - c0) / (reps * n))
                        opts.log(f"round {r} {arm} {n} x {page // 1024} KiB: "
                                 f"{median(xs) / n * 1e6:.2f} us/page")
        # One write checked page by page: the bytes landed where the lists said.
        page = page_sizes[0]
        n = min(pages[-1], 4096, region // page)
        await ca.set_tensor(src.tensor(0, n * page), bytes(range(256)) * (n * page // 256))
        si, di = _indices(rng, n, n), _indices(rng, n, n)
        await paged(page, n, si, di)
        want = await ca.get_tensor(src.tensor(0, n * page))
        got = await cb.get_tensor(dst.tensor(0, n * page))
        bad = [k for k in range(n) if got[di[k] * page:(di[k] + 1) * page]
               != want[si[k] * page:(si[k] + 1) * page]]
        if bad:
            raise AssertionError(f"{len(bad)} of {n} pages differ after a paged write")
    finally:
        await ca.close()
        await cb.close()
    return {"rounds": rounds, "per": per, "cpu": cpu}


def run(opts: Options, pages: tuple[int, ...] | None = None,
        page_sizes: tuple[int, ...] = PAGE_SIZES, region: int = REGION) -> BenchResult:
    """The figure; fewer ``pages``, ``page_sizes`` or a smaller ``region`` for a smaller one."""
    import uvloop

    pages = pages or opts.pick(PAGES, (256, 1024, 4096))
    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    with pair_and_floor(s, region, res.notes) as (a, b, sock), client_on(s.initiator):
        pids = {"transferd": [a.pid, b.pid],
                "plain socket": [sock.initiator.pid, sock.target.pid] if sock else []}
        m = uvloop.run(_measure(opts, a.url, b.url, sock, pages, page_sizes, region, pids))
    per, cpu = m["per"], m["cpu"]
    summary: dict[str, Any] = {}
    arms = ("transferd", "plain socket")
    for page in page_sizes:
        t = Table(f"{page // 1024} KiB pages: microseconds per page, submit to completion, and "
                  f"CPU microseconds per page of both sides' processes ({m['rounds']} "
                  "alternating rounds, median)",
                  ["pages", "bytes", "transferd us/page", "plain socket us/page",
                   "transferd / socket", "transferd CPU us/page", "plain socket CPU us/page",
                   "transferd GiB/s"])
        wall: dict[str, list[float]] = {x: [] for x in arms}
        work: dict[str, list[float]] = {x: [] for x in arms}
        for n in pages:
            key = f"{page}/{n}"
            row: dict[str, float] = {}
            for arm in arms:
                if per[key][arm]:
                    wall[arm].append(median(per[key][arm]))
                    work[arm].append(median(cpu[key][arm]))
                    row[arm], row[arm + " cpu"] = wall[arm][-1], work[arm][-1]
                else:
                    row[arm] = row[arm + " cpu"] = float("nan")
            td, so = row["transferd"], row["plain socket"]
            cyc = " (cyclic)" if n * page > region else ""
            t.add(n, f"{n * page / 2**20:,.0f} MiB{cyc}", f"{td * 1e6:.2f}", f"{so * 1e6:.2f}",
                  fmt_ratio(td / so), f"{row['transferd cpu'] * 1e6:.2f}",
                  f"{row['plain socket cpu'] * 1e6:.2f}", f"{page / td / 2**30:.2f}")
            summary[key] = {"transferd_s_per_page": td, "socket_s_per_page": so,
                            "transferd_cpu_s_per_page": row["transferd cpu"],
                            "socket_cpu_s_per_page": row["plain socket cpu"]}
        res.tables.append(t)
        for arm in arms:
            if not wall[arm]:
                continue
            w_ratio = max(wall[arm]) / min(wall[arm])
            c_ratio = max(work[arm]) / min(work[arm])
            growth = worst_growth(work[arm])
            summary[f"{page} flatness {arm}"] = w_ratio
            summary[f"{page} cpu flatness {arm}"] = c_ratio
            summary[f"{page} cpu growth {arm}"] = growth
            if arm == "transferd":
                # CPU time per page is the work per page (the wall time adds whatever the
                # machine's other processes made this one wait); growth, not the fixed
                # cost of a write spread over few pages, is what would not be flat.
                res.checks.append(Check(
                    f"(2) {page // 1024} KiB pages {pages[0]}..{pages[-1]}: worst growth of "
                    "the CPU time per page from fewer pages to more", growth, "<=", FLAT, "x"))
            res.notes.append(f"{page // 1024} KiB pages, {arm}: largest / smallest per-page "
                             f"time {w_ratio:.2f}x (wall), {c_ratio:.2f}x (CPU); worst growth "
                             f"to more pages {growth:.2f}x (CPU)")
    res.notes.append(f"placement: {s.describe()}")
    res.notes.append(
        f"regions of {region >> 20} MiB a side: a write of more pages than that holds goes "
        "over the region cyclically (fresh random permutations of its pages, one after "
        "another); every page is still its own entry, iovec and receive")
    res.data = {"pages": list(pages), "page_sizes": list(page_sizes), "region": region,
                "summary": summary, **m}
    return res
