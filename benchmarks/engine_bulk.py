"""(a) A 1 GiB single write daemon to daemon, and (d) the daemons' peak memory meanwhile.

Arms, each a writer and a reader process on loopback, placed alike (see
:mod:`benchmarks.engine_common`), measured in alternating rounds:

- ``transferd``: daemon A (``rpc-server``, one rail on 127.0.0.1) writes 1 GiB
  from a registered region into daemon B's registered region:
  ``await (await client.submit_single_write(1 GiB, None, src, dst))``, timed
  in the client from the submit to the completion EVENT (sent once B has
  acknowledged that the bytes are in place).
- ``plain socket`` (the baseline, target >= 0.9x): one Python process
  ``sendall``s the same 1 GiB from a buffer, the other ``recv_into``s it into
  its buffer and answers one byte; timed from the send to that byte.
- ``Mooncake TE (tcp)`` and ``NIXL (UCX tcp)``, where they install: one
  ``transfer_sync_write`` / one posted WRITE request of 1 GiB between two
  engines (see :mod:`benchmarks.engine_peers`).

Every target buffer is touched before the first write and every arm makes one
untimed write first.  After the rounds each target's CRC-32 is checked
against its source's.  (d): VmHWM of both daemons (``/proc/PID/status``) at
the end, less the 1 GiB each registered; target under 64 MiB each.
"""

from __future__ import annotations

import asyncio
import time

from .engine_common import (
    LABELS,
    SECTION,
    FilledArm,
    GiB,
    MiB,
    client_on,
    crc_remote,
    only_running,
    sides,
    start_arms,
    vm_status,
)
from .harness import (
    BenchResult,
    Check,
    Options,
    Table,
    fmt_ratio,
    interleave,
    median,
    quiet_gc,
)

NAME = "engine_bulk"
TITLE = "(a) 1 GiB single write daemon to daemon vs a plain socket; (d) daemon peak memory"
SECTION = SECTION

SIZE = GiB
QUICK_SIZE = 256 * MiB
TARGET_RATIO = 0.9
TARGET_OVERHEAD = 64 * MiB
PEERS = ("socket", "mooncake", "nixl")
TIMEOUT = 120.0


class _Transferd(FilledArm):
    """Daemons A and B, 1 GiB registered on each, driven by a client in this process."""

    async def _write(self, size: int) -> float:
        t0 = time.perf_counter()
        c = await self.ca.submit_single_write(size, None, (self.mr, 0), (self.desc, 0))
        await asyncio.wait_for(c, TIMEOUT)
        return time.perf_counter() - t0

    def bulk(self, size: int) -> float:
        return float(self.loop.run_until_complete(self._write(size)))

    def target_crc(self, size: int) -> int:
        return int(self.loop.run_until_complete(crc_remote(self.cb, self.dst, size)))


def run(opts: Options) -> BenchResult:
    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    size = opts.pick(SIZE, QUICK_SIZE)
    rounds = opts.pick(7, 3)
    with start_arms(s, lambda a_url, b_url: _Transferd(a_url, b_url, size), PEERS, size,
                    opts.log) as started:
        arms = started.by_label
        times: dict[str, list[float]] = {k: [] for k in arms}
        with client_on(s.initiator):
            pairs = started.pairs.values()
            for arm in arms.values():  # one untimed write each
                only_running(pairs, arm)
                arm.bulk(size)
            for r, name in interleave(list(arms), rounds):
                only_running(pairs, arms[name])
                with quiet_gc():
                    dt = arms[name].bulk(size)
                times[name].append(dt)
                opts.log(f"round {r} {name}: {size / dt / GiB:.2f} GiB/s")
            for pair in pairs:
                pair.pause(False)  # (the checks below ask them)
            crc_ok = {name: arm.target_crc(size) == arm.source_crc for name, arm in arms.items()}
        mem = {"daemon A": vm_status(started.a.pid), "daemon B": vm_status(started.b.pid)}
        for kind, pair in started.pairs.items():
            m = pair.memory()
            mem[f"{LABELS[kind]} initiator"] = m["initiator"]
            mem[f"{LABELS[kind]} target"] = m["target"]
        missing = started.missing

    bad = [name for name, ok in crc_ok.items() if not ok]
    if bad:
        raise AssertionError(f"target bytes differ from the source after: {', '.join(bad)}")
    base = "plain socket" if "plain socket" in times else None
    rates = {k: [size / t for t in v] for k, v in times.items()}
    what = f"{size / GiB:g} GiB" if size >= GiB else f"{size // MiB} MiB"
    table = Table(
        f"{what} single write on loopback, {rounds} alternating rounds per arm "
        "(median of rounds; GiB/s; ratio = per-round rate / plain socket's, median)",
        ["arm", "GiB/s", "best GiB/s", "s", "vs plain socket", "transferd vs it", "target"],
    )
    summary: dict[str, dict[str, float]] = {}
    for name, rs in rates.items():
        med = median(rs)
        ratio = (median([x / y for x, y in zip(rs, rates[base], strict=True)])
                 if base else float("nan"))
        mine = median([x / y for x, y in zip(rates["transferd"], rs, strict=True)])
        summary[name] = {"gib_s": med / GiB, "best_gib_s": max(rs) / GiB,
                         "seconds": median(times[name]), "vs_socket": ratio,
                         "transferd_vs": mine}
        target = f">= {TARGET_RATIO}x socket" if name == "transferd" else (
            "transferd ahead" if name in (LABELS["mooncake"], LABELS["nixl"]) else "")
        table.add(name, f"{med / GiB:.2f}", f"{max(rs) / GiB:.2f}",
                  f"{median(times[name]):.3f}", fmt_ratio(ratio),
                  "" if name == "transferd" else fmt_ratio(mine), target)
    for kind, why in missing.items():
        table.add(LABELS[kind], "-", "-", "-", "-", "-", f"not available: {why}")
    res.tables.append(table)

    mt = Table("(d) peak memory during (a): VmHWM from /proc/PID/status (MiB)",
               ["process", "VmHWM", "registered", "overhead", "target"])
    overhead = {}
    for proc, usage in mem.items():
        over = usage["hwm"] - size
        overhead[proc] = over
        mt.add(proc, f"{usage['hwm'] / MiB:,.0f}", f"{size / MiB:,.0f}", f"{over / MiB:,.1f}",
               f"< {TARGET_OVERHEAD // MiB} MiB" if proc.startswith("daemon") else "")
    res.tables.append(mt)

    if base:
        res.checks.append(Check(f"(a) {what} write, transferd / plain socket",
                                summary["transferd"]["vs_socket"], ">=", TARGET_RATIO, "x"))
    else:
        res.notes.append(f"plain socket baseline not available: {missing.get('socket')}")
    for kind in ("mooncake", "nixl"):
        if LABELS[kind] in summary:
            res.checks.append(Check(f"(a) {what} write, transferd / {LABELS[kind]}",
                                    summary[LABELS[kind]]["transferd_vs"], ">=", 1.0, "x"))
    for proc in ("daemon A", "daemon B"):
        res.checks.append(Check(f"(d) {proc} VmHWM - registered {what}",
                                overhead[proc] / MiB, "<=", TARGET_OVERHEAD / MiB, " MiB"))
    for kind, why in missing.items():
        res.notes.append(f"{LABELS[kind]}: not available: {why}")
    res.notes.append(f"placement: {s.describe()}")
    res.notes.append(
        "every target buffer touched before timing, one untimed write per arm; CRC-32 of "
        "each target checked against its source after the rounds")
    res.data = {"size": size, "rounds": rounds, "times": times, "summary": summary,
                "memory": mem, "overhead": overhead, "missing": missing,
                "placement": s.describe()}
    return res
