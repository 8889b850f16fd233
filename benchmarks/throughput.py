"""(c) set and get throughput of 64 MiB tensors against a plain Python socket.

Arms, measured by one client process (pinned) against servers pinned to
another CPU, in alternating rounds:

- ``plain socket``: blocking sockets on both ends (:mod:`benchmarks.baselines`
  ``bulk``).  *set*: the client ``sendall``s 64 MiB, the server
  ``recv_into``s a preallocated buffer and answers one byte; *get*: the client
  sends a 9-byte request, the server ``sendall``s 64 MiB, the client
  ``recv_into``s a preallocated buffer.  Timed from the first byte sent to the
  last byte received.
- ``daemon``: the real async :class:`client.Client` on uvloop against the real
  ``rpc-server``: ``await c.set_tensor(t, data)`` (SET_TENSOR, the reply
  included) and ``await c.get_tensor(t, out=buf)`` (into a preallocated buffer,
  like ``recv_into``); ``get_tensor(t)`` without ``out=`` is reported too.

Checksums (CRC-32) of what arrived are verified for every arm in every round,
outside the timed region.  Target: each daemon direction at least 0.8x the
plain socket's throughput.
"""

from __future__ import annotations

import socket
import struct
import time
import zlib
from typing import Any

from .baselines import BULK_REQ
from .harness import (
    BenchResult,
    Check,
    Options,
    ServerProcess,
    Table,
    baseline_command,
    fmt_rate,
    fmt_ratio,
    interleave,
    median,
    quiet_gc,
    start_daemon,
)

NAME = "throughput"
TITLE = "set/get throughput of 64 MiB tensors vs a plain Python socket"
SECTION = "Protocol (issue 2)"

SIZE = 64 * 2**20
TARGET = 0.8


def _data(size: int) -> bytes:
    import numpy as np

    return np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8).tobytes()


class _Plain:
    """The client half of the plain-socket baseline (blocking)."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.sock = socket.create_connection(addr)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ack = bytearray(1)

    def _recv_exact(self, view: memoryview) -> None:
        got, n = 0, len(view)
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if not k:
                raise ConnectionError("baseline server closed")
            got += k

    def set(self, data: bytes) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(BULK_REQ.pack(b"S", len(data)))
        self.sock.sendall(data)
        self._recv_exact(memoryview(self.ack))
        return time.perf_counter() - t0

    def get(self, out: memoryview) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(BULK_REQ.pack(b"G", len(out)))
        self._recv_exact(out)
        return time.perf_counter() - t0

    def server_crc(self) -> int:
        self.sock.sendall(BULK_REQ.pack(b"C", 0))
        raw = bytearray(8)
        self._recv_exact(memoryview(raw))
        return int(struct.unpack("<Q", raw)[0])

    def close(self) -> None:
        self.sock.close()


async def _daemon_arms(opts: Options, url: str, plain: _Plain, data: bytes) -> dict[str, Any]:
    import asyncio

    from client import Client

    rounds = opts.pick(5, 2)
    reps = opts.pick(3, 2)
    want = zlib.crc32(data)
    c = await Client.connect(url)
    out = bytearray(SIZE)
    out_view = memoryview(out)
    try:
        buf = await c.alloc_buffer(SIZE)
        t = buf.tensor(0, SIZE)
        clock = time.perf_counter

        async def d_set() -> float:
            t0 = clock()
            await c.set_tensor(t, data)
            return clock() - t0

        async def d_get() -> float:
            t0 = clock()
            await c.get_tensor(t, out=out)
            return clock() - t0

        async def d_get_alloc() -> float:
            t0 = clock()
            await c.get_tensor(t)
            return clock() - t0

        async def p_set() -> float:
            return plain.set(data)

        async def p_get() -> float:
            return plain.get(out_view)

        arms = {
            ("set", "plain socket"): p_set,
            ("set", "daemon"): d_set,
            ("get", "plain socket"): p_get,
            ("get", "daemon out="): d_get,
            ("get", "daemon (new buffer)"): d_get_alloc,
        }

        async def verify(key: tuple[str, str]) -> None:
            op, arm = key
            if arm == "plain socket":
                got = plain.server_crc() if op == "set" else zlib.crc32(out)
            elif op == "set":
                got = zlib.crc32(await c.get_tensor(t))
            elif arm == "daemon out=":
                got = zlib.crc32(out)
            else:
                got = zlib.crc32(await c.get_tensor(t))
            if got != want:
                raise AssertionError(f"{op} {arm}: CRC-32 {got:08x}, expected {want:08x}")

        # Warm up every arm once (page faults, socket buffers), then verify.
        for key, fn in arms.items():
            out[:16] = b"\0" * 16
            await fn()
            await verify(key)
        times: dict[tuple[str, str], list[list[float]]] = {k: [] for k in arms}
        verified: dict[str, int] = {f"{k[0]} {k[1]}": 0 for k in arms}
        for r, key in interleave(list(arms), rounds):
            out[:16] = b"\0" * 16
            with quiet_gc():
                xs = [await arms[key]() for _ in range(reps)]
            times[key].append(xs)
            await verify(key)  # after the timed reps, outside the timing
            verified[f"{key[0]} {key[1]}"] += 1
            opts.log(f"round {r} {key}: {fmt_rate(SIZE / median(xs))} MiB/s")
            await asyncio.sleep(0)
    finally:
        await c.close()
    return {"rounds": rounds, "reps": reps, "times": times, "verified": verified}


def run(opts: Options) -> BenchResult:
    import uvloop

    res = BenchResult(NAME, TITLE, SECTION)
    data = _data(SIZE)
    with (
        start_daemon(opts.pinning) as daemon,
        ServerProcess(
            baseline_command("bulk", "--size", str(SIZE)), opts.pinning, name="bulk"
        ) as bulk,
    ):
        plain = _Plain(bulk.host_port)
        try:
            m = uvloop.run(_daemon_arms(opts, daemon.url, plain, data))
        finally:
            plain.close()
    times = m["times"]
    # Per round: the median of that round's reps; the figure is the median over rounds.
    per_round = {k: [median(xs) for xs in v] for k, v in times.items()}
    table = Table(
        f"64 MiB per transfer, {m['rounds']} alternating rounds x {m['reps']} transfers per arm "
        "(MiB/s, median over rounds; CRC-32 verified after every round)",
        ["direction", "arm", "MiB/s", "ms", "vs plain socket", "target"],
    )
    summary: dict[str, dict[str, float]] = {}
    for (op, arm), rounds in per_round.items():
        base = per_round[(op, "plain socket")]
        ratio = median([b / x for x, b in zip(rounds, base, strict=True)])
        sec = median(rounds)
        summary[f"{op} {arm}"] = {"seconds": sec, "bytes_per_s": SIZE / sec, "ratio": ratio}
        target = ""
        if arm in ("daemon", "daemon out="):
            target = f">= {TARGET}x: {'PASS' if ratio >= TARGET else 'MISS'}"
        table.add(op, arm, fmt_rate(SIZE / sec), f"{sec * 1e3:,.1f}", fmt_ratio(ratio), target)
        if target:
            res.checks.append(
                Check(f"{op} 64 MiB: daemon / plain socket throughput", ratio, ">=", TARGET, "x")
            )
    res.tables.append(table)
    res.notes.append(
        "plain socket = blocking sendall / recv_into a preallocated buffer, one byte of "
        "acknowledgement for a set; daemon = client.Client.set_tensor / get_tensor(out=) on "
        f"uvloop; every arm's data checked by CRC-32 ({sum(m['verified'].values())} checks)"
    )
    res.data = {
        "size": SIZE,
        "summary": summary,
        "rounds": m["rounds"],
        "reps": m["reps"],
        "times": {f"{k[0]} {k[1]}": v for k, v in times.items()},
        "verified": m["verified"],
    }
    return res
