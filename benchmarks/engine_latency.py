"""(e) A 4 KiB write from a client's submit to its completion, p50 and p99.

Arms, in alternating rounds, each ``n`` sequential 4 KiB writes timed one by
one, placed alike (see :mod:`benchmarks.engine_common`):

- ``transferd, loop worker``: the async client, pinned with daemon A, times
  ``await (await c.submit_single_write(4096, None, src, dst))``: the SINGLE_WRITE
  frame to daemon A, A's WRITE to daemon B on loopback, B's ACK once the bytes
  are in place, and A's completion EVENT back to the client.  A's host group
  runs on its own event loop (``engine.worker = "loop"``, the default).
- ``transferd, loop worker, unix client``: the same daemons, the client on A's
  Unix socket (a client on the same node).
- ``transferd, thread worker``: a second pair of daemons with
  ``engine.worker = "thread"``: A's group on a worker thread, two thread
  hand-offs per write (the engine before issue 12).
- ``plain socket`` (the floor of any TCP design): 8-byte length + 4 KiB
  ``sendall`` from one process, ``recv_into`` a buffer in the other, one byte
  back; the least a write-and-acknowledge round trip can cost here.
- ``Mooncake TE (tcp)``: ``transfer_sync_write`` of 4 KiB between two engines.
- ``NIXL (UCX tcp)``: a prepared WRITE request reposted, completion busy-polled.

Mooncake and NIXL run where they install (benchmark-only venv) and are
reported "not available: <reason>" otherwise.  Figures are the median over
rounds of each round's p50 and p99.  Targets (issue 12): the default arm's p50
at most 1.5x the plain socket's, its p99 no worse than the plain socket's;
(issue 3) its p50 ahead of Mooncake's and NIXL's.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from .engine_common import (
    LABELS,
    SECTION,
    MiB,
    Sides,
    TransferdArm,
    client_on,
    only_running,
    sides,
    start_pair,
    start_peers,
    write_rtts,
)
from .harness import (
    BenchResult,
    Check,
    Options,
    ServerProcess,
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
MAIN = "transferd, loop worker"
UNIX = "transferd, loop worker, unix client"
THREAD = "transferd, thread worker"


class _Transferd(TransferdArm):
    async def fill(self) -> None:
        await self.ca.buffer_clear(self.src, 0x5A)
        await super().fill()

    def lat(self, n: int, size: int) -> list[float]:
        return list(self.loop.run_until_complete(
            write_rtts(self.ca, self.mr, self.desc, size, n)))

    def check(self) -> bool:
        async def check() -> bool:
            got = await self.cb.get_tensor(self.dst.tensor(0, SIZE))
            return bytes(got) == b"\x5a" * SIZE

        return bool(self.loop.run_until_complete(check()))


@contextlib.contextmanager
def _transferd_arms(s: Sides) -> Iterator[dict[str, _Transferd]]:
    """Two daemon pairs (loop and thread workers), the three transferd arms on them."""
    where = tempfile.mkdtemp(prefix="td-lat-", dir="/tmp")
    daemons: list[ServerProcess] = []
    arms: dict[str, _Transferd] = {}
    try:
        a, b = start_pair(s, env={"TRANSFERD_ENGINE_WORKER": "loop"},
                          a_args=("--listen", f"unix://{where}/a.sock"))
        daemons += [a, b]
        ta, tb = start_pair(s, env={"TRANSFERD_ENGINE_WORKER": "thread"})
        daemons += [ta, tb]
        unix = next(u for u in a.urls if u.startswith("unix://"))
        with client_on(s.initiator):
            for label, (a_url, b_url) in {MAIN: (a.url, b.url), UNIX: (unix, b.url),
                                          THREAD: (ta.url, tb.url)}.items():
                arm = _Transferd(a_url, b_url, BUF)
                arms[label] = arm
                arm.setup()
        yield arms
    finally:
        for arm in arms.values():
            arm.close()
        for d in daemons:
            d.stop()
        shutil.rmtree(where, ignore_errors=True)


def run(opts: Options) -> BenchResult:
    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    n = opts.pick(2000, 500)
    rounds = opts.pick(6, 3)
    warm = opts.pick(300, 100)
    with _transferd_arms(s) as mine:
        opts.log("transferd: ready")
        pairs, missing = start_peers(PEERS, BUF, s, opts.log)
        try:
            arms: dict[str, Any] = {**mine, **{LABELS[k]: p for k, p in pairs.items()}}
            per_round: dict[str, list[dict[str, float]]] = {k: [] for k in arms}
            with client_on(s.initiator):
                for arm in arms.values():
                    only_running(pairs.values(), arm)
                    arm.lat(warm, SIZE)
                for r, name in interleave(list(arms), rounds):
                    only_running(pairs.values(), arms[name])
                    with quiet_gc():
                        xs = arms[name].lat(n, SIZE)
                    per_round[name].append({"p50": percentile(xs, 50),
                                            "p99": percentile(xs, 99),
                                            "mean": sum(xs) / len(xs)})
                    opts.log(f"round {r} {name}: p50 {fmt_us(per_round[name][-1]['p50'])} us")
                for label, arm in mine.items():
                    if not arm.check():
                        raise AssertionError(f"{label}: daemon B's region does not hold the "
                                             "written bytes")
        finally:
            for pair in pairs.values():
                pair.stop()

    summary = {
        name: {"p50": median([x["p50"] for x in rows]), "p99": median([x["p99"] for x in rows]),
               "mean": median([x["mean"] for x in rows])}
        for name, rows in per_round.items()
    }
    # Each round's ratio to the plain socket's same round (arms interleaved), then the median.
    floor = LABELS["socket"]
    ratios: dict[str, dict[str, float]] = {}
    if floor in per_round:
        for name, rows in per_round.items():
            ratios[name] = {q: median([x[q] / f[q] for x, f in zip(rows, per_round[floor],
                                                                   strict=True)])
                            for q in ("p50", "p99")}
    main = summary[MAIN]
    table = Table(
        f"4 KiB write, submit to completion, {rounds} alternating rounds x {n} writes per arm "
        "(median over rounds; us)",
        ["arm", "p50 us", "p99 us", "mean us", "p50 / plain socket's", "p99 / plain socket's",
         "target"],
    )
    targets = {MAIN: "p50 <= 1.5x, p99 <= 1x the plain socket's; ahead of Mooncake, NIXL",
               LABELS["mooncake"]: "transferd ahead", LABELS["nixl"]: "transferd ahead"}
    for name, v in summary.items():
        rr = ratios.get(name, {})
        table.add(name, fmt_us(v["p50"]), fmt_us(v["p99"]), fmt_us(v["mean"]),
                  fmt_ratio(rr.get("p50", float("nan"))), fmt_ratio(rr.get("p99", float("nan"))),
                  targets.get(name, ""))
    for kind, why in missing.items():
        table.add(LABELS[kind], "-", "-", "-", "-", "-", f"not available: {why}")
    res.tables.append(table)
    if MAIN in ratios:
        res.checks.append(Check("(e) 4 KiB p50, transferd / plain socket",
                                ratios[MAIN]["p50"], "<=", 1.5, "x"))
        res.checks.append(Check("(e) 4 KiB p99, transferd / plain socket",
                                ratios[MAIN]["p99"], "<=", 1.0, "x"))
    for kind in ("mooncake", "nixl"):
        label = LABELS[kind]
        if label in summary:
            res.checks.append(Check(f"(e) 4 KiB p50, transferd / {label}",
                                    main["p50"] / summary[label]["p50"], "<=", 1.0, "x"))
        else:
            res.notes.append(f"{label}: not available: {missing.get(kind)}")
    if floor not in summary:
        res.notes.append(f"plain socket floor not available: {missing.get('socket')}")
    res.notes.append(f"placement: {s.describe()}")
    res.notes.append(
        "transferd's path is client -> daemon A -> daemon B -> daemon A -> client (4 TCP "
        "hops; the thread worker adds 2 thread hand-offs in A); the others time one "
        "engine-to-engine round trip inside the initiating process. Ratios are per round "
        "(interleaved arms), then the median")
    res.data = {"size": SIZE, "n": n, "rounds": rounds, "summary": summary, "ratios": ratios,
                "per_round": per_round, "missing": missing, "placement": s.describe()}
    return res
