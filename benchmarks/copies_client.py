"""The client half of :mod:`benchmarks.copies`: runs every data path, reads every count.

Started by :mod:`benchmarks.copies` as ``python -m benchmarks.copies_client`` with
``TRANSFERD_COUNT_COPIES=1`` (and, where a C compiler was found, the memcpy counter
preloaded), against daemons A and B started the same way.  For each path it takes,
before and after ``reps`` operations: this process's own counts
(:func:`transferd.copies.snapshot`), each daemon's (STATS ``copies``), and the
memcpy/memmove counters of all three processes (files the preloaded library maps).
Prints one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import struct
import sys
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from transferd import copies

Counts = dict[str, dict[str, int]]


def memcount(path: str | None) -> list[int] | None:
    """calls, bytes (of at least MEMCOUNT_MIN), all_calls, all_bytes; None without one."""
    if not path or not os.path.exists(path):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        return list(struct.unpack("<4Q", os.pread(fd, 32, 0)))
    finally:
        os.close(fd)


class Probe:
    """Every count of the three processes at one moment."""

    def __init__(self, ca: Any, cb: Any, files: dict[str, str | None]) -> None:
        self.ca, self.cb, self.files = ca, cb, files

    async def take(self) -> dict[str, Any]:
        a = (await self.ca.server_stats()).get("copies", {})
        b = (await self.cb.server_stats()).get("copies", {})
        return {
            "counted": {"client": copies.snapshot(), "daemon A": a, "daemon B": b},
            "memcpy": {k: memcount(p) for k, p in self.files.items()},
        }


def difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"counted": {}, "memcpy": {}}
    for proc, snap in after["counted"].items():
        out["counted"][proc] = copies.delta(snap, before["counted"][proc])
    for proc, m in after["memcpy"].items():
        b = before["memcpy"][proc]
        out["memcpy"][proc] = None if m is None or b is None else {
            "calls": m[0] - b[0], "bytes": m[1] - b[1],
            "all_calls": m[2] - b[2], "all_bytes": m[3] - b[3]}
    return out


def pattern(size: int, seed: int) -> bytes:
    return bytes((i * 131 + seed) & 0xFF for i in range(256)) * (size // 256) + bytes(size % 256)


async def paths_at(size: int, ca: Any, cb: Any, cu: Any, cs: Any, probe: Probe, quick: bool
                   ) -> list[dict[str, Any]]:
    """Every path at one size: ``reps`` operations each, the counts' differences."""
    from client import Pages

    reps = max(4, min(256, (64 << 20) // max(size, 1) // 4))
    if quick:
        reps = max(4, reps // 8)
    src = await ca.alloc_buffer(size * 2)
    dst = await cb.alloc_buffer(size * 2)
    shm = await cu.alloc_shared(size * 2)
    mr, _ = await ca.reg_mr(src)
    _, desc = await cb.reg_mr(dst)
    _, shm_desc = await cu.reg_mr(shm)
    data = pattern(size, size & 0xFF)
    crc = zlib.crc32(data)
    await ca.set_tensor(src.tensor(0, size), data)
    out = bytearray(size)
    mutable = bytearray(data)  # set_tensor_async copies a mutable buffer (copy=True)
    page = min(size, 4096)
    npages = size // page

    async def set_() -> None:
        await ca.set_tensor(src.tensor(0, size), data)

    async def get() -> None:
        got = await ca.get_tensor(src.tensor(0, size))
        if len(got) != size:
            raise AssertionError("short get")

    async def get_out() -> None:
        await ca.get_tensor(src.tensor(0, size), out=out)

    async def set_queued() -> None:
        ca.set_tensor_async(src.tensor(size, size), mutable)
        await ca.flush()

    async def get_batched() -> None:
        n = 8
        step = size // n
        futs = [ca.get_tensor_async(src.tensor(k * step, step)) for k in range(n)]
        await ca.flush()
        await asyncio.gather(*futs)

    async def single_write() -> None:
        done = await ca.submit_single_write(size, None, (mr, 0), (desc, 0))
        await done.wait(30)

    async def paged_write() -> None:
        idx = list(range(npages))[::-1]
        done = await ca.submit_paged_writes(
            page, None, (mr, Pages(list(range(npages)), page)), (desc, Pages(idx, page)))
        await done.wait(30)

    async def shared_set() -> None:
        await cu.set_tensor(shm.tensor(0, size), data)

    async def shared_get() -> None:
        await cu.get_tensor(shm.tensor(0, size), out=out)

    async def set_on(c: Any) -> None:
        await c.set_tensor(dst.tensor(size, size), data)

    async def get_on(c: Any) -> None:
        await c.get_tensor(dst.tensor(size, size), out=out)

    async def write_into_shared() -> None:
        done = await ca.submit_single_write(size, None, (mr, 0), (shm_desc, size))
        await done.wait(30)

    paths: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("set_tensor", set_), ("get_tensor", get), ("get_tensor out=", get_out),
        ("set_tensor_async + flush", set_queued),
        ("get_tensor_async x8 + flush", get_batched),
        ("single write A->B", single_write),
        (f"paged write A->B ({npages} x {page // 1024} KiB)", paged_write),
        ("shared buffer set_tensor", shared_set),
        ("shared buffer get_tensor out=", shared_get),
        ("single write A->B shared buffer", write_into_shared),
        ("set_tensor over unix:// (to B)", functools.partial(set_on, cu)),
        ("get_tensor out= over unix:// (from B)", functools.partial(get_on, cu)),
        ("set_tensor over seqpacket:// (to B)", functools.partial(set_on, cs)),
        ("get_tensor out= over seqpacket:// (from B)", functools.partial(get_on, cs)),
    ]
    # What reading the counts costs by itself (STATS replies are copied too):
    # taken off every path's memcpy figures.
    t0 = await probe.take()
    idle = difference(await probe.take(), t0)
    results: list[dict[str, Any]] = []
    for name, fn in paths:
        await fn()  # warm: links open, buffers sized
        before = await probe.take()
        for _ in range(reps):
            await fn()
        after = await probe.take()
        results.append({"path": name, "size": size, "reps": reps, "moved": size * reps,
                        "idle": idle, **difference(after, before)})
    # The bytes arrived: B's buffer and the shared buffer hold what A sent.
    if zlib.crc32(await cb.get_tensor(dst.tensor(0, size))) != zlib.crc32(
            await ca.get_tensor(src.tensor(0, size))):
        raise AssertionError("daemon B's buffer differs from A's after the writes")
    if zlib.crc32(bytes(shm.view[size:2 * size])) != crc:
        raise AssertionError("the shared buffer differs from A's after the write")
    if zlib.crc32(out) != crc:
        raise AssertionError("get_tensor(out=) filled other bytes")
    await cu.free_buffer(shm)
    await ca.free_buffer(src)
    await cb.free_buffer(dst)
    return results


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    from client import Client

    files = {"client": a.memcount_client, "daemon A": a.memcount_a, "daemon B": a.memcount_b}
    ca = await Client.connect(a.a)
    cb = await Client.connect(a.b)
    cu = await Client.connect(a.b_unix)  # B over unix: shared buffers
    cs = await Client.connect(a.b_seqpacket)
    results: list[dict[str, Any]] = []
    try:
        for size in a.sizes:
            results += await paths_at(size, ca, cb, cu, cs, Probe(ca, cb, files), a.quick)
    finally:
        for c in (ca, cb, cu, cs):
            await c.close()
    return {"counting": copies.COUNTING, "results": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.copies_client")
    ap.add_argument("--a", required=True, help="daemon A's tcp URL")
    ap.add_argument("--b", required=True, help="daemon B's tcp URL")
    ap.add_argument("--b-unix", required=True, help="daemon B's unix URL")
    ap.add_argument("--b-seqpacket", required=True, help="daemon B's seqpacket URL")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[4096, 4 << 20])
    ap.add_argument("--memcount-client")
    ap.add_argument("--memcount-a")
    ap.add_argument("--memcount-b")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    if not copies.COUNTING:
        print(json.dumps({"error": f"{copies.ENV}=1 is not set"}))
        return 2
    import uvloop

    doc = uvloop.run(main_async(a))
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
