"""(3) Peers: one daemon writing to 1, 4 and 16 peer daemons: throughput, memory per link.

Daemon A (the initiator side's CPU, with the client that drives it) writes 4 MiB
single writes from one region into a region on each of ``k`` peer daemons (the target
side's CPU), all peers at once: the same bytes in all (``TOTAL`` per measurement, so
``TOTAL / k`` per peer), every write in flight from the start.  Aggregate throughput =
bytes / time from the first submit to the last completion.

The floor, in the same rounds: one asyncio process on the initiator's CPU sending the
same 4 MiB payloads over ``k`` plain TCP connections at once to ``k`` of
:mod:`benchmarks.scale_baselines`' ``ack`` servers on the target's CPU (each write
acknowledged once received), every write of a connection sent at once as well.

Memory per link: daemon A's VmRSS and open descriptors after its first link (one warm
write to the first peer), then after links to 4 and to 16 peers (one write to each);
per link = the growth over the links added.  Those are the initiator's own costs (its
link objects, its send queue, the socket); the kernel's socket buffers are not in RSS.
"""

from __future__ import annotations

import asyncio
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .engine_common import client_on, sides
from .harness import (
    BenchResult,
    Options,
    Pinning,
    ServerProcess,
    Table,
    daemon_command,
    fmt_ratio,
    median,
    quiet_gc,
)
from .scale_baselines import AckClient
from .scale_common import SECTION, cpu_seconds, fd_count, rss_bytes

NAME = "scale_peers"
TITLE = "(3) one daemon writing to 1, 4 and 16 peer daemons: throughput, memory and fds per link"
SECTION = SECTION

PEERS = (1, 4, 16)
WRITE = 4 << 20
TIMEOUT = 120.0


def start_all(argvs: list[list[str]], pinning: Pinning, names: list[str]) -> list[ServerProcess]:
    """Start servers side by side (each waits for its ready line); all or none."""
    procs = [ServerProcess(argv, pinning, name=n) for argv, n in zip(argvs, names, strict=True)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        futs = [pool.submit(p.start) for p in procs]
        errors = [f.exception() for f in futs]
    if any(errors):
        for p in procs:
            p.stop()
        raise RuntimeError(f"a server did not start: {next(e for e in errors if e)}")
    return procs


async def _measure(opts: Options, a: ServerProcess, peers: list[ServerProcess],
                   acks: list[ServerProcess], counts: tuple[int, ...], total: int | None
                   ) -> dict[str, Any]:
    from client import Client

    total = total or opts.pick(128 << 20, 64 << 20)
    rounds = opts.pick(2, 1)
    ca = await Client.connect(a.url)
    cbs = [await Client.connect(p.url) for p in peers]
    conns: list[Any] = []
    try:
        src = await ca.alloc_buffer(WRITE)
        data = bytes((i * 29 + 5) & 0xFF for i in range(256)) * (WRITE // 256)
        await ca.set_tensor(src.tensor(), data)
        mr, _ = await ca.reg_mr(src)
        descs = []
        dsts = []
        for cb in cbs:
            dst = await cb.alloc_buffer(WRITE)
            await cb.buffer_clear(dst, 0)
            dsts.append(dst)
            descs.append((await cb.reg_mr(dst))[1])

        async def write(i: int) -> None:
            done = await ca.submit_single_write(WRITE, None, (mr, 0), (descs[i], 0))
            await done.wait(TIMEOUT)

        # Memory and descriptors per link, as links are added.
        memory: list[dict[str, int]] = []
        linked = 0
        for k in sorted({1, *counts}):
            await asyncio.gather(*(write(i) for i in range(linked, k)))
            linked = max(linked, k)
            memory.append({"links": linked, "rss": rss_bytes(a.pid), "fds": fd_count(a.pid)})
        loop = asyncio.get_running_loop()
        for s in acks:
            _, proto = await loop.create_connection(lambda: AckClient(data), *s.host_port)
            conns.append(proto)

        cpu_per_gib: dict[int, list[float]] = {k: [] for k in counts}

        async def transferd(k: int) -> float:
            per = max(1, total // WRITE // k)
            c0 = cpu_seconds(a.pid)
            t0 = time.perf_counter()
            await asyncio.gather(*(write(i) for i in range(k) for _ in range(per)))
            wall = time.perf_counter() - t0
            # Daemon A's CPU time (all its threads) per GiB sent.
            cpu_per_gib[k].append((cpu_seconds(a.pid) - c0) / (k * per * WRITE / 2**30))
            return k * per * WRITE / wall

        async def floor(k: int) -> float:
            per = max(1, total // WRITE // k)

            t0 = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*(c.burst(per) for c in conns[:k])), TIMEOUT)
            return k * per * WRITE / (time.perf_counter() - t0)

        await transferd(max(counts))
        await floor(max(counts))
        for xs in cpu_per_gib.values():
            xs.clear()  # the warm-up is not a measurement
        per_round: dict[int, dict[str, list[float]]] = {
            k: {"transferd": [], "plain socket": []} for k in counts}
        for r in range(rounds):
            for k in counts:
                arms = [("transferd", transferd), ("plain socket", floor)]
                if (r + k) % 2:
                    arms.reverse()
                for name, fn in arms:
                    with quiet_gc():
                        per_round[k][name].append(await fn(k))
                    opts.log(f"round {r} x{k} {name}: {per_round[k][name][-1] / 2**30:.2f} GiB/s")
        want = zlib.crc32(data)
        for i, (cb, dst) in enumerate(zip(cbs, dsts, strict=True)):
            if zlib.crc32(await cb.get_tensor(dst.tensor())) != want:
                raise AssertionError(f"peer {i}'s region does not hold what A wrote")
    finally:
        for c in conns:
            if c.transport is not None:
                c.transport.close()
        for c in (ca, *cbs):
            await c.close()
    return {"total": total, "rounds": rounds, "per_round": per_round, "memory": memory,
            "cpu_per_gib": cpu_per_gib}


def run(opts: Options, counts: tuple[int, ...] = PEERS, total: int | None = None) -> BenchResult:
    """The figure; fewer peers (``counts``) or fewer bytes (``total``) for a smaller one."""
    import uvloop

    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    n = max(counts)
    a = ServerProcess(daemon_command(), s.initiator, name="daemon A").start()
    started: list[ServerProcess] = [a]
    try:
        peers = start_all([daemon_command() for _ in range(n)], s.target,
                          [f"peer {i}" for i in range(n)])
        started += peers
        acks = start_all([[sys.executable, "-m", "benchmarks.scale_baselines", "ack", "--read",
                           str(WRITE)]
                          for _ in range(n)], s.target, [f"ack {i}" for i in range(n)])
        started += acks
        with client_on(s.initiator):
            m = uvloop.run(_measure(opts, a, peers, acks, counts, total))
    finally:
        for p in started:
            p.stop()
    t = Table(f"4 MiB single writes, {m['total'] >> 20} MiB per measurement spread over the "
              f"peers, {m['rounds']} alternating round(s) (median)",
              ["peers", "transferd GiB/s", "plain socket GiB/s", "transferd / socket",
               "transferd vs 1 peer", "daemon A CPU s per GiB"])
    summary: dict[str, Any] = {}
    one = median(m["per_round"][counts[0]]["transferd"])
    for k in counts:
        v = m["per_round"][k]
        td, so = median(v["transferd"]), median(v["plain socket"])
        ratio = median([x / y for x, y in zip(v["transferd"], v["plain socket"], strict=True)])
        cpu = median(m["cpu_per_gib"][k])
        t.add(k, f"{td / 2**30:.2f}", f"{so / 2**30:.2f}", fmt_ratio(ratio), fmt_ratio(td / one),
              f"{cpu:.2f}")
        summary[str(k)] = {"transferd_bytes_per_s": td, "socket_bytes_per_s": so,
                           "ratio": ratio, "daemon_a_cpu_s_per_gib": cpu}
    res.tables.append(t)
    mem = m["memory"]
    mt = Table("daemon A (the initiator) as links are added: VmRSS and open descriptors",
               ["links", "VmRSS MiB", "fds", "RSS per added link KiB", "fds per added link"])
    for prev, cur in zip([None, *mem[:-1]], mem, strict=True):
        if prev is None or cur["links"] == prev["links"]:
            mt.add(cur["links"], f"{cur['rss'] / 2**20:.1f}", cur["fds"], "", "")
            continue
        added = cur["links"] - prev["links"]
        mt.add(cur["links"], f"{cur['rss'] / 2**20:.1f}", cur["fds"],
               f"{(cur['rss'] - prev['rss']) / added / 1024:.0f}",
               f"{(cur['fds'] - prev['fds']) / added:.2f}")
    res.tables.append(mt)
    first, last = mem[0], mem[-1]
    if last["links"] > first["links"]:
        k = last["links"] - first["links"]
        per_rss = (last["rss"] - first["rss"]) / k
        per_fd = (last["fds"] - first["fds"]) / k
        summary["rss_per_link"] = per_rss
        summary["fds_per_link"] = per_fd
        res.notes.append(f"from {first['links']} to {last['links']} links: "
                         f"{per_rss / 1024:.0f} KiB of VmRSS and {per_fd:.2f} descriptors "
                         "per link on the initiator")
    res.notes.append(f"placement: {s.describe()}; the floor's writer is this process, on "
                     "the initiator's CPU, its ack servers on the target's")
    res.data = {"counts": list(counts), "summary": summary, **m,
                "per_round": {str(k): v for k, v in m["per_round"].items()},
                "cpu_per_gib": {str(k): v for k, v in m["cpu_per_gib"].items()}}
    return res
