"""(i) What a small write costs: CPU per 4 KiB write in each daemon, and the rate at 64 in flight.

Placed as every engine figure (see :mod:`benchmarks.engine_common`): daemon A and the
client on one CPU, daemon B on the other.  In alternating rounds:

- ``transferd``: the client awaits ``n`` sequential 4 KiB writes A -> B; the CPU time
  of daemon A and of daemon B meanwhile (every thread's ``schedstat``), per write;
- ``plain socket``: the baseline of ``engine_latency`` (8-byte length + 4 KiB
  ``sendall``, ``recv_into`` in the other process, one byte back), ``n`` messages;
  the CPU of its server (the target process) and of its initiator, per message;
- ``transferd, 64 in flight``: the client keeps 64 writes of 4 KiB outstanding for
  ``seconds``; completions per second.

Targets (issue 17): daemon A's CPU per write at most 2.5x, daemon B's at most 1.5x the
plain socket server's per message; the 64-in-flight rate is compared with the figure
before issue 17 in docs/benchmarks.md (at least 2x).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .engine_common import (
    SECTION,
    MiB,
    PeerPair,
    TransferdArm,
    client_on,
    sides,
    start_pair,
)
from .harness import BenchResult, Check, Options, Table, fmt_ratio, interleave, median, quiet_gc
from .scale_common import cpu_seconds

NAME = "engine_small"
TITLE = "(i) 4 KiB write: CPU per write in daemons A and B, and the rate at 64 in flight"
SECTION = SECTION

SIZE = 4096
WINDOW = 64


class _Arm(TransferdArm):
    async def _seq(self, n: int) -> None:
        submit = self.ca.submit_single_write
        src, dst = (self.mr, 0), (self.desc, 0)
        for _ in range(n):
            await (await submit(SIZE, None, src, dst))

    async def _rate(self, seconds: float) -> float:
        submit = self.ca.submit_single_write
        src, dst = (self.mr, 0), (self.desc, 0)
        loop = asyncio.get_running_loop()
        inflight: list[Any] = []
        done = 0
        t0 = time.perf_counter()
        stop = loop.time() + seconds
        while loop.time() < stop:
            while len(inflight) < WINDOW:
                inflight.append(await submit(SIZE, None, src, dst))
            await inflight.pop(0)
            done += 1
        for c in inflight:
            await c
            done += 1
        return done / (time.perf_counter() - t0)

    def seq(self, n: int) -> None:
        self.loop.run_until_complete(self._seq(n))

    def rate(self, seconds: float) -> float:
        return float(self.loop.run_until_complete(self._rate(seconds)))

    def check(self) -> bool:
        async def check() -> bool:
            got = await self.cb.get_tensor(self.dst.tensor(0, SIZE))
            want = await self.ca.get_tensor(self.src.tensor(0, SIZE))
            return bytes(got) == bytes(want)

        return bool(self.loop.run_until_complete(check()))


def _per(pids: dict[str, int], run: Any, n: int) -> dict[str, float]:
    """CPU microseconds per operation of each process while ``run()`` does ``n``."""
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    run()
    return {k: (cpu_seconds(p) - before[k]) / n * 1e6 for k, p in pids.items()}


def run(opts: Options) -> BenchResult:
    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    n = opts.pick(3000, 600)
    rounds = opts.pick(6, 2)
    seconds = opts.pick(1.5, 0.5)
    a, b = start_pair(s)
    arm = pair = None
    rows: dict[str, list[dict[str, float]]] = {"transferd": [], "socket": [], "rate": []}
    try:
        with client_on(s.initiator):
            arm = _Arm(a.url, b.url, 1 * MiB)
            arm.setup()
            arm.seq(300)
            arm.rate(0.2)
        pair = PeerPair("socket", 1 * MiB, s)
        pair.lat(300, SIZE)
        pids_t = {"A": a.pid, "B": b.pid}
        pids_s = {"server": pair.target.pid, "initiator": pair.initiator.pid}
        with client_on(s.initiator):
            for _, name in interleave(["transferd", "socket", "rate"], rounds):
                with quiet_gc():
                    if name == "transferd":
                        rows[name].append(_per(pids_t, lambda: arm.seq(n), n))
                    elif name == "socket":
                        rows[name].append(_per(pids_s, lambda: pair.lat(n, SIZE), n))
                    else:
                        rows[name].append({"rate": arm.rate(seconds)})
            ok = arm.check()
    finally:
        if arm is not None:
            arm.close()
        if pair is not None:
            pair.stop()
        b.stop()
        a.stop()
    t, sk = rows["transferd"], rows["socket"]
    a_ratio = median([x["A"] / y["server"] for x, y in zip(t, sk, strict=True)])
    b_ratio = median([x["B"] / y["server"] for x, y in zip(t, sk, strict=True)])
    table = Table(f"{rounds} alternating rounds: {n} sequential 4 KiB writes (transferd) or "
                  f"messages (plain socket); CPU us per operation, every thread "
                  "(schedstat), median over rounds; ratios per round, then the median",
                  ["process", "CPU us / op", "/ plain socket server's", "target"])
    table.add("daemon A", f"{median([x['A'] for x in t]):,.1f}", fmt_ratio(a_ratio), "<= 2.5x")
    table.add("daemon B", f"{median([x['B'] for x in t]):,.1f}", fmt_ratio(b_ratio), "<= 1.5x")
    table.add("plain socket server", f"{median([y['server'] for y in sk]):,.1f}", "1.00x", "")
    table.add("plain socket initiator", f"{median([y['initiator'] for y in sk]):,.1f}",
              fmt_ratio(median([y["initiator"] / y["server"] for y in sk])), "")
    res.tables.append(table)
    rate = median([x["rate"] for x in rows["rate"]])
    rt = Table(f"4 KiB writes with {WINDOW} in flight, one client connection, {seconds:g} s "
               "a round (median over rounds)", ["arm", "writes/s"])
    rt.add(f"transferd, {WINDOW} in flight", f"{rate:,.0f}")
    res.tables.append(rt)
    res.checks.append(Check("(i) daemon A CPU per 4 KiB write / plain socket server's",
                            a_ratio, "<=", 2.5, "x"))
    res.checks.append(Check("(i) daemon B CPU per 4 KiB write / plain socket server's",
                            b_ratio, "<=", 1.5, "x"))
    res.checks.append(Check("(i) the written bytes are B's", 1.0 if ok else 0.0, "==", 1.0))
    res.notes.append(f"placement: {s.describe()}")
    res.data = {"rows": rows, "a_ratio": a_ratio, "b_ratio": b_ratio, "rate": rate, "n": n}
    return res
