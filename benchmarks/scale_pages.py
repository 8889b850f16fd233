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

Reported: microseconds per page for each ``P`` and page size, both arms (the median
of the rounds, and the best round: other work on the machine only ever adds time), and
the flatness ratio (the largest per-page time over the smallest, per arm and page size,
of the medians and of the best rounds; the target is on the best rounds): 1.0 is
perfectly flat.
"""

from __future__ import annotations

import random
import time
from typing import Any

from .engine_common import PeerPair, PeerUnavailable, client_on, sides, start_pair
from .harness import BenchResult, Check, Options, Table, fmt_ratio, median, quiet_gc
from .scale_common import SECTION

NAME = "scale_pages"
TITLE = "(2) paged write time per page, 256..65,536 pages of 4 KiB and 64 KiB vs plain sockets"
SECTION = SECTION

PAGES = (256, 1024, 4096, 16384, 65536)
PAGE_SIZES = (4096, 65536)
REGION = 256 << 20
TIMEOUT = 120.0
# Flat: the largest per-page time at most this many times the smallest.
FLAT = 1.5


def _indices(rng: random.Random, pages: int, region_pages: int) -> list[int]:
    out: list[int] = []
    while len(out) < pages:
        out += rng.sample(range(region_pages), min(region_pages, pages - len(out)))
    return out


async def _measure(opts: Options, a_url: str, b_url: str, sock: PeerPair | None,
                   pages: tuple[int, ...], page_sizes: tuple[int, ...], region: int
                   ) -> dict[str, Any]:
    from client import Client, Pages

    rounds = opts.pick(3, 2)
    rng = random.Random(20261201)
    ca = await Client.connect(a_url)
    cb = await Client.connect(b_url)
    per: dict[str, dict[str, list[float]]] = {}  # "page/P" -> arm -> per-page seconds
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
                    reps = max(1, opts.pick(16 << 20, 8 << 20) // (n * page))
                    order = ["transferd", "plain socket"]
                    if (r + n) % 2:
                        order.reverse()
                    for arm in order:
                        if arm == "plain socket" and sock is None:
                            continue
                        with quiet_gc():
                            if arm == "transferd":
                                xs = [await paged(page, n) for _ in range(reps)]
                            else:
                                xs = [sock_paged(page, n) for _ in range(reps)]
                        slot[arm].append(median(xs) / n)
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
    return {"rounds": rounds, "per": per}


def run(opts: Options, pages: tuple[int, ...] | None = None,
        page_sizes: tuple[int, ...] = PAGE_SIZES, region: int = REGION) -> BenchResult:
    """The figure; fewer ``pages``, ``page_sizes`` or a smaller ``region`` for a smaller one."""
    import uvloop

    pages = pages or opts.pick(PAGES, (256, 1024, 4096))
    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    a, b = start_pair(s)
    sock: PeerPair | None = None
    try:
        try:
            sock = PeerPair("socket", region, s)
        except PeerUnavailable as exc:
            res.notes.append(f"plain socket floor not available: {exc}")
        with client_on(s.initiator):
            m = uvloop.run(_measure(opts, a.url, b.url, sock, pages, page_sizes, region))
    finally:
        if sock is not None:
            sock.stop()
        a.stop()
        b.stop()
    per = m["per"]
    summary: dict[str, Any] = {}
    for page in page_sizes:
        t = Table(f"{page // 1024} KiB pages: microseconds per page, submit to completion "
                  f"({m['rounds']} alternating rounds: median, and best of the rounds)",
                  ["pages", "bytes", "transferd us/page", "best", "plain socket us/page",
                   "best", "transferd / socket", "transferd GiB/s"])
        flat: dict[str, list[float]] = {"transferd": [], "plain socket": []}
        best: dict[str, list[float]] = {"transferd": [], "plain socket": []}
        for n in pages:
            v = per[f"{page}/{n}"]
            td = median(v["transferd"])
            so = median(v["plain socket"]) if v["plain socket"] else float("nan")
            flat["transferd"].append(td)
            best["transferd"].append(min(v["transferd"]))
            sb = float("nan")
            if v["plain socket"]:
                flat["plain socket"].append(so)
                sb = min(v["plain socket"])
                best["plain socket"].append(sb)
            cyc = " (cyclic)" if n * page > region else ""
            t.add(n, f"{n * page / 2**20:,.0f} MiB{cyc}", f"{td * 1e6:.2f}",
                  f"{best['transferd'][-1] * 1e6:.2f}", f"{so * 1e6:.2f}", f"{sb * 1e6:.2f}",
                  fmt_ratio(td / so), f"{page / td / 2**30:.2f}")
            summary[f"{page}/{n}"] = {"transferd_s_per_page": td, "socket_s_per_page": so,
                                      "transferd_best_s_per_page": best["transferd"][-1],
                                      "socket_best_s_per_page": sb}
        res.tables.append(t)
        for arm, xs in flat.items():
            if xs:
                ratio = max(xs) / min(xs)
                bs = best[arm]
                best_ratio = max(bs) / min(bs)
                summary[f"{page} flatness {arm}"] = ratio
                summary[f"{page} flatness {arm} best"] = best_ratio
                if arm == "transferd":
                    # Interference only adds time: the best round is the cost itself.
                    res.checks.append(Check(
                        f"(2) {page // 1024} KiB pages {pages[0]}..{pages[-1]}: largest / "
                        "smallest per-page time (best of the rounds)", best_ratio, "<=", FLAT,
                        "x"))
                res.notes.append(f"{page // 1024} KiB pages, {arm}: largest / smallest "
                                 f"per-page time {ratio:.2f}x of the medians, "
                                 f"{best_ratio:.2f}x of the best rounds")
    res.notes.append(f"placement: {s.describe()}")
    res.notes.append(
        f"regions of {region >> 20} MiB a side: a write of more pages than that holds goes "
        "over the region cyclically (fresh random permutations of its pages, one after "
        "another); every page is still its own entry, iovec and receive")
    res.data = {"pages": list(pages), "page_sizes": list(page_sizes), "region": region,
                "summary": summary, **m}
    return res
