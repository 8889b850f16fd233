"""(e) A 4 KiB write from a client's submit to its completion, p50 and p99.

Arms, in alternating rounds, each ``n`` sequential 4 KiB writes timed one by
one, placed alike (see :mod:`benchmarks.engine_common`):

- ``transferd``: the async client, pinned with daemon A, times
  ``await (await c.submit_single_write(4096, None, src, dst))``: the SINGLE_WRITE
  frame to daemon A, its worker's WRITE to daemon B on loopback, B's ACK once
  the bytes are in place, and A's completion EVENT back to the client.
- ``plain socket`` (the floor of any TCP design): 8-byte length + 4 KiB
  ``sendall`` from one process, ``recv_into`` a buffer in the other, one byte
  back; the least a write-and-acknowledge round trip can cost here.
- ``Mooncake TE (tcp)``: ``transfer_sync_write`` of 4 KiB between two engines.
- ``NIXL (UCX tcp)``: a prepared WRITE request reposted, completion busy-polled.

Mooncake and NIXL run where they install (benchmark-only venv) and are
reported "not available: <reason>" otherwise.  Figures are the median over
rounds of each round's p50 and p99.  Target (issue 3): transferd's p50 ahead
of both Mooncake's and NIXL's.
"""

from __future__ import annotations

import time

from .engine_common import (
    LABELS,
    SECTION,
    MiB,
    TransferdArm,
    client_on,
    sides,
    start_arms,
)
from .harness import (
    BenchResult,
    Check,
    Options,
    Table,
    fmt_ratio,
    fmt_us,
    interleave,
    median,
    percentile,
    quiet_gc,
)

NAME = "engine_latency"
TITLE = "(e) 4 KiB write, client submit to completion: p50 and p99"
SECTION = SECTION

SIZE = 4096
BUF = 1 * MiB
PEERS = ("socket", "mooncake", "nixl")


class _Transferd(TransferdArm):
    async def fill(self) -> None:
        await self.ca.buffer_clear(self.src, 0x5A)
        await super().fill()

    async def _lat(self, n: int, size: int) -> list[float]:
        submit = self.ca.submit_single_write
        src, dst = (self.mr, 0), (self.desc, 0)
        clock = time.perf_counter
        out = []
        for _ in range(n):
            t0 = clock()
            await (await submit(size, None, src, dst))
            out.append(clock() - t0)
        return out

    def lat(self, n: int, size: int) -> list[float]:
        return list(self.loop.run_until_complete(self._lat(n, size)))

    def check(self) -> bool:
        async def check() -> bool:
            got = await self.cb.get_tensor(self.dst.tensor(0, SIZE))
            return bytes(got) == b"\x5a" * SIZE

        return bool(self.loop.run_until_complete(check()))


def run(opts: Options) -> BenchResult:
    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    n = opts.pick(2000, 500)
    rounds = opts.pick(5, 3)
    warm = opts.pick(300, 100)
    with start_arms(s, lambda a_url, b_url: _Transferd(a_url, b_url, BUF), PEERS, BUF,
                    opts.log) as started:
        arms = started.by_label
        per_round: dict[str, list[dict[str, float]]] = {k: [] for k in arms}
        with client_on(s.initiator):
            for arm in arms.values():
                arm.lat(warm, SIZE)
            for r, name in interleave(list(arms), rounds):
                with quiet_gc():
                    xs = arms[name].lat(n, SIZE)
                per_round[name].append({"p50": percentile(xs, 50), "p99": percentile(xs, 99),
                                        "mean": sum(xs) / len(xs)})
                opts.log(f"round {r} {name}: p50 {fmt_us(per_round[name][-1]['p50'])} us")
            if not started.transferd.check():
                raise AssertionError("daemon B's region does not hold the written bytes")
        missing = started.missing

    summary = {
        name: {"p50": median([x["p50"] for x in rows]), "p99": median([x["p99"] for x in rows]),
               "mean": median([x["mean"] for x in rows])}
        for name, rows in per_round.items()
    }
    mine = summary["transferd"]
    table = Table(
        f"4 KiB write, submit to completion, {rounds} alternating rounds x {n} writes per arm "
        "(median over rounds; us)",
        ["arm", "p50 us", "p99 us", "mean us", "transferd p50 / its p50",
         "transferd p99 / its p99", "target"],
    )
    for name, v in summary.items():
        target = ("p50 ahead of Mooncake and NIXL" if name == "transferd"
                  else "transferd ahead" if name in (LABELS["mooncake"], LABELS["nixl"]) else "")
        table.add(name, fmt_us(v["p50"]), fmt_us(v["p99"]), fmt_us(v["mean"]),
                  "" if name == "transferd" else fmt_ratio(mine["p50"] / v["p50"]),
                  "" if name == "transferd" else fmt_ratio(mine["p99"] / v["p99"]), target)
    for kind, why in missing.items():
        table.add(LABELS[kind], "-", "-", "-", "-", "-", f"not available: {why}")
    res.tables.append(table)
    for kind in ("mooncake", "nixl"):
        label = LABELS[kind]
        if label in summary:
            res.checks.append(Check(f"(e) 4 KiB p50, transferd / {label}",
                                    mine["p50"] / summary[label]["p50"], "<=", 1.0, "x"))
        else:
            res.notes.append(f"{label}: not available: {missing.get(kind)}")
    if "plain socket" not in summary:
        res.notes.append(f"plain socket floor not available: {missing.get('socket')}")
    res.notes.append(f"placement: {s.describe()}")
    res.notes.append(
        "transferd's path is client -> daemon A -> daemon B -> daemon A -> client (4 TCP hops "
        "and 2 thread hand-offs in A); the others time one engine-to-engine round trip "
        "inside the initiating process")
    res.data = {"size": SIZE, "n": n, "rounds": rounds, "summary": summary,
                "per_round": per_round, "missing": missing, "placement": s.describe()}
    return res
