"""(f) A local client reading 1 GiB that a remote daemon wrote into its shared buffer.

Daemon A (the writer's side) writes 1 GiB from a registered host buffer into a
shared buffer (``device="shm"``) that a client of daemon B allocated over B's
Unix socket and registered.  The bytes land in pages the client has mapped;
what the client then does to *read* them is what is timed:

- ``shared (page walk)``: touch one byte of every page of ``buf.array`` (the
  data is already in the client's memory: no copy exists to be made);
- ``shared (read every byte)``: a full pass over the bytes in place
  (``numpy.bitwise_xor.reduce`` over uint64 words), the cheapest way to
  actually consume every byte;
- ``memcpy`` (the baseline): one ``numpy.copyto`` of the same 1 GiB into a
  buffer of the client's, touched beforehand — what a copy, however fast,
  costs at the least;
- ``get_tensor(out=)``: the same 1 GiB read over the Unix socket from a host
  (cpu) buffer of B, into the same touched buffer — the way without shared
  memory.

Target: the page walk far below the memcpy (ratio <= 0.1x).  The first walk,
which also maps the pages into the client's page tables, is timed apart.  The shared
buffer's CRC-32 is checked against the source after the rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
import zlib
from typing import Any

import numpy as np

from .engine_common import SECTION, GiB, MiB, client_on, fill_remote, sides
from .harness import (
    BenchResult,
    Check,
    Options,
    ServerProcess,
    Table,
    daemon_command,
    fmt_ratio,
    interleave,
    median,
    quiet_gc,
)

NAME = "shm_read"
TITLE = "(f) local client reads 1 GiB a remote daemon wrote into its shared buffer vs a memcpy"
SECTION = SECTION

SIZE = GiB
QUICK_SIZE = 256 * MiB
TARGET = 0.1
TIMEOUT = 120.0
PAGE = 4096


def _page_walk(arr: np.ndarray) -> float:
    t0 = time.perf_counter()
    int(arr[::PAGE].sum())
    return time.perf_counter() - t0


def _read_all(arr: np.ndarray) -> float:
    t0 = time.perf_counter()
    int(np.bitwise_xor.reduce(arr.view(np.uint64)))
    return time.perf_counter() - t0


def _memcpy(dst: np.ndarray, src: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


async def _bench(a_url: str, b_unix: str, size: int, rounds: int, log: Any
                 ) -> dict[str, Any]:
    from client import Client

    async with await Client.connect(a_url) as ca, await Client.connect(b_unix) as cb:
        src = await ca.alloc_buffer(size)
        source_crc = await fill_remote(ca, src, size)
        src_mr, _ = await ca.reg_mr(src)
        shared = await cb.alloc_shared(size)
        _, desc = await cb.reg_mr(shared)
        host = await cb.alloc_buffer(size)  # the get_tensor arm's source on B
        await cb.buffer_clear(host, 0x5A)
        t0 = time.perf_counter()
        done = await ca.submit_single_write(size, None, (src_mr, 0), (desc, 0))
        await asyncio.wait_for(done, TIMEOUT)
        write_s = time.perf_counter() - t0
        arr = shared.array
        # The first walk also maps the pages into this process's page tables
        # (minor faults: the daemon wrote them through its own mapping).
        first_s = _page_walk(arr)
        dst = np.ones(size, dtype=np.uint8)  # touched: no page faults in the copy
        times: dict[str, list[float]] = {k: [] for k in (
            "shared (page walk)", "shared (read every byte)", "memcpy", "get_tensor(out=)")}
        for r, name in interleave(list(times), rounds):
            with quiet_gc():
                if name == "shared (page walk)":
                    dt = _page_walk(arr)
                elif name == "shared (read every byte)":
                    dt = _read_all(arr)
                elif name == "memcpy":
                    dt = _memcpy(dst, arr)
                else:
                    t1 = time.perf_counter()
                    await cb.get_tensor(host.tensor(), out=dst)
                    dt = time.perf_counter() - t1
            times[name].append(dt)
            log(f"round {r} {name}: {dt * 1e3:.1f} ms")
        crc_ok = zlib.crc32(shared.view) == source_crc
        del arr, dst
        await cb.free_buffer(shared)
        await cb.free_buffer(host)
        await ca.free_buffer(src)
    return {"times": times, "crc_ok": crc_ok, "write_s": write_s, "first_s": first_s}


def run(opts: Options) -> BenchResult:
    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    size = opts.pick(SIZE, QUICK_SIZE)
    rounds = opts.pick(7, 3)
    mem = str(2 * size // MiB + 64)
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "b.sock")
        a = ServerProcess(daemon_command("-m", mem), s.initiator, name="daemon A").start()
        b = None
        try:
            b = ServerProcess(daemon_command("-m", mem, "--unix", sock), s.target,
                              name="daemon B",
                              env={"TRANSFERD_MEMORY_SHM_LIMIT_MIB": mem}).start()
            unix = next(u for u in b.urls if u.startswith(("unix:", "seqpacket:")))
            import uvloop

            with client_on(s.target):  # the local client lives on B's side
                out = uvloop.run(_bench(a.url, unix, size, rounds, opts.log))
        finally:
            with contextlib.suppress(Exception):
                if b is not None:
                    b.stop()
            a.stop()
    if not out["crc_ok"]:
        raise AssertionError("the shared buffer's bytes differ from the source")
    times = out["times"]
    base = median(times["memcpy"])
    what = f"{size / GiB:g} GiB" if size >= GiB else f"{size // MiB} MiB"
    table = Table(
        f"reading {what} a remote daemon wrote into a shared buffer, {rounds} alternating "
        "rounds per arm (median; ratio = arm / memcpy)",
        ["arm", "ms", "best ms", "GiB/s", "vs memcpy", "target"])
    summary: dict[str, dict[str, float]] = {}
    for name, ts in times.items():
        med = median(ts)
        summary[name] = {"seconds": med, "best": min(ts), "vs_memcpy": med / base}
        table.add(name, f"{med * 1e3:.1f}", f"{min(ts) * 1e3:.1f}", f"{size / med / GiB:.1f}",
                  fmt_ratio(med / base),
                  f"<= {TARGET}x memcpy" if name == "shared (page walk)" else "")
    res.tables.append(table)
    res.checks.append(Check(f"(f) {what} shared read (page walk) / memcpy",
                            summary["shared (page walk)"]["vs_memcpy"], "<=", TARGET, "x"))
    res.notes.append(f"the remote write itself took {out['write_s']:.3f} s "
                     f"({size / out['write_s'] / GiB:.2f} GiB/s); placement: {s.describe()}")
    res.notes.append(f"the first page walk, which also faults the pages into the client's "
                     f"page tables, took {out['first_s'] * 1e3:.1f} ms "
                     f"({out['first_s'] / base:.2f}x the memcpy); the rounds above come after it")
    res.notes.append("the memcpy and get_tensor destinations are touched before timing; "
                     "CRC-32 of the shared buffer checked against the source")
    res.data = {"size": size, "rounds": rounds, "times": times, "summary": summary,
                "write_s": out["write_s"], "first_s": out["first_s"],
                "placement": s.describe()}
    return res
