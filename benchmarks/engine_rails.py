"""(c) Rails: one write over 2 and 4 rate-limited rails against the same over 1.

Two "hosts" in network namespaces, joined by four veth rails, each limited
by ``tc tbf`` to the same rate on both ends (the topology of the multi-host
test, built by :mod:`benchmarks.netns`).  Three pairs of daemons run at once,
one daemon of each pair in each namespace, with 1, 2 and 4 rails
(``[engine] host_rails`` = the first 1, 2 or 4 rail addresses); their client
RPC ports sit on the namespaces' management links, so this process drives all
of them.  Each round writes the same bytes A -> B once per pair
(``submit_single_write``, split by the engine over all its rails), pairs in
alternating order; the aggregate rate is size / time from submit to the
completion.  Ratios (2 rails / 1 rail, 4 rails / 1 rail) are taken per round
and the median reported.  Targets: 1.85x and 3.6x.  Every pair's destination
is checked against its source (CRC-32) at the end, and the bytes each rail
carried are read from the veths' counters.

Needs root and ``ip netns``; elsewhere the figure is "not available: <reason>".
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from . import netns
from .engine_common import SECTION, MiB, crc_remote, fill_remote, sides
from .harness import BenchResult, Check, Options, ServerProcess, Table, fmt_ratio, median

NAME = "engine_rails"
TITLE = "(c) aggregate over 2 and 4 rate-limited rails vs 1 rail (network namespaces, tc)"
SECTION = SECTION

RATE_MBIT = 250
RAILS = (1, 2, 4)
TARGETS = {2: 1.85, 4: 3.6}
TIMEOUT = 120.0


async def _measure(opts: Options, urls: dict[int, tuple[str, str]], size: int,
                   rounds: int) -> dict[str, Any]:
    from client import Client

    setups: dict[int, Any] = {}
    try:
        for rails, (ua, ub) in urls.items():
            ca = await Client.connect(ua)
            cb = await Client.connect(ub)
            src = await ca.alloc_buffer(size)
            dst = await cb.alloc_buffer(size)
            crc = await fill_remote(ca, src, size)
            await cb.buffer_clear(dst, 0)
            mr, _ = await ca.reg_mr(src)
            _, desc = await cb.reg_mr(dst)
            setups[rails] = (ca, cb, dst, mr, desc, crc)

        async def write(rails: int, n: int) -> float:
            ca, _, _, mr, desc, _ = setups[rails]
            t0 = time.perf_counter()
            done = await ca.submit_single_write(n, None, (mr, 0), (desc, 0))
            await asyncio.wait_for(done.wait(), TIMEOUT)
            return time.perf_counter() - t0

        for rails in RAILS:  # open every rail's link before timing
            await write(rails, 4 * MiB)
        times: dict[int, list[float]] = {r: [] for r in RAILS}
        for r in range(rounds):
            order = RAILS if r % 2 == 0 else tuple(reversed(RAILS))
            for rails in order:
                dt = await write(rails, size)
                times[rails].append(dt)
                opts.log(f"round {r} {rails} rail(s): {size * 8 / dt / 1e6:.0f} Mbit/s")
        crc_ok = {}
        for rails, (_, cb, dst, _, _, crc) in setups.items():
            crc_ok[rails] = await crc_remote(cb, dst, size) == crc
    finally:
        for ca, cb, *_ in setups.values():
            await ca.close()
            await cb.close()
    return {"times": times, "crc_ok": crc_ok}


def run(opts: Options) -> BenchResult:
    import uvloop

    res = BenchResult(NAME, TITLE, SECTION)
    reason = netns.unavailable()
    if reason is not None:
        res.notes.append(f"not available: {reason}")
        res.data = {"available": False, "reason": reason}
        return res
    s = sides(opts)
    size = opts.pick(64 * MiB, 32 * MiB)
    rounds = opts.pick(3, 2)
    daemons: list[ServerProcess] = []
    with netns.Topology(rails=max(RAILS), rate_mbit=RATE_MBIT) as topo:
        try:
            urls: dict[int, tuple[str, str]] = {}
            for rails in RAILS:
                pair = []
                for host, pin in ((topo.a, s.initiator), (topo.b, s.target)):
                    cfg = host.engine_config(rails, topo.workdir)
                    d = ServerProcess(host.daemon_argv(cfg), pin,
                                      name=f"{rails}-rail daemon in {host.ns}")
                    daemons.append(d)
                    pair.append(d.start().url)
                urls[rails] = (pair[0], pair[1])
            before = [topo.rail_bytes(topo.a, r) for r in range(max(RAILS))]
            m = uvloop.run(_measure(opts, urls, size, rounds))
            carried = [topo.rail_bytes(topo.a, r) - before[r] for r in range(max(RAILS))]
        finally:
            for d in daemons:
                d.stop()
    bad = [r for r, ok in m["crc_ok"].items() if not ok]
    if bad:
        raise AssertionError(f"destination differs from source on the {bad}-rail pair(s)")
    times = m["times"]
    ratios = {
        r: median([t1 / tr for t1, tr in zip(times[1], times[r], strict=True)]) for r in RAILS
    }
    table = Table(
        f"{size // MiB} MiB single write A -> B, rails limited to {RATE_MBIT} Mbit/s each "
        f"(tc tbf, both ends), {rounds} alternating rounds (median)",
        ["rails", "Mbit/s", "per rail", "s", "vs 1 rail", "target"],
    )
    for r in RAILS:
        t = median(times[r])
        mbit = size * 8 / t / 1e6
        table.add(str(r), f"{mbit:.0f}", f"{mbit / r:.0f}", f"{t:.2f}", fmt_ratio(ratios[r]),
                  f">= {TARGETS[r]}x" if r in TARGETS else "")
    res.tables.append(table)
    for r, target in TARGETS.items():
        res.checks.append(Check(f"(c) {r} rails / 1 rail", ratios[r], ">=", target, "x"))
    res.notes.append(
        "bytes sent by host A per rail over the whole run (veth tx counters): "
        + ", ".join(f"rail{i} {b / MiB:.0f} MiB" for i, b in enumerate(carried)))
    res.notes.append(f"placement: {s.describe()}; every pair's daemon A in namespace a, "
                     "daemon B in namespace b")
    res.data = {"size": size, "rate_mbit": RATE_MBIT, "rounds": rounds, "times": times,
                "ratios": ratios, "carried": carried}
    return res
