"""What the scaling figures (issue 12) share: closed-loop drivers, CPU time, memory, fds."""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .harness import percentile

SECTION = "How cost grows (issue 12)"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time of a process so far, all its threads: nanoseconds from each thread's
    ``schedstat`` (clock ticks of ``/proc/PID/stat`` where there is none)."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK


def own_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Load:
    """One closed-loop measurement: every worker keeps one operation outstanding."""

    ops: int
    wall: float
    latencies: list[float]
    server_cpu: float  # seconds of CPU the servers used meanwhile, all together
    client_cpu: float  # seconds of CPU this process used meanwhile

    @property
    def rate(self) -> float:
        return self.ops / self.wall if self.wall > 0 else 0.0

    @property
    def p50(self) -> float:
        return percentile(self.latencies, 50)

    @property
    def p99(self) -> float:
        return percentile(self.latencies, 99)

    def to_json(self) -> dict[str, Any]:
        return {"ops": self.ops, "wall_s": self.wall, "ops_per_s": self.rate,
                "p50_s": self.p50, "p99_s": self.p99, "server_cpu_s": self.server_cpu,
                "client_cpu_s": self.client_cpu,
                "server_cpu_frac": self.server_cpu / self.wall if self.wall else 0.0,
                "client_cpu_frac": self.client_cpu / self.wall if self.wall else 0.0}


async def closed_loop(ops: Sequence[Callable[[], Awaitable[Any]]], duration: float,
                      server_pids: Sequence[int] = (), max_ops: int = 10_000_000) -> Load:
    """Run every ``ops[i]`` back to back in its own task for ``duration`` seconds (and at
    least once each: on a loaded machine a task may first run after the deadline)."""
    clock = time.perf_counter
    lats: list[list[float]] = [[] for _ in ops]
    start = asyncio.Event()
    deadline = 0.0

    async def worker(op: Callable[[], Awaitable[Any]], out: list[float]) -> None:
        await start.wait()
        append = out.append
        for i in range(max_ops):
            t0 = clock()
            if i and t0 >= deadline:
                return  # every worker makes at least one operation, however late it starts
            await op()
            append(clock() - t0)

    tasks = [asyncio.ensure_future(worker(op, out)) for op, out in zip(ops, lats, strict=True)]
    await asyncio.sleep(0)
    cpu0 = [cpu_seconds(p) for p in server_pids]
    own0 = own_cpu_seconds()
    t_start = clock()
    deadline = t_start + duration
    start.set()
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), duration + 60)
    finally:
        for t in tasks:
            t.cancel()
    wall = clock() - t_start
    server = sum(cpu_seconds(p) - c for p, c in zip(server_pids, cpu0, strict=True))
    flat = [x for xs in lats for x in xs]
    return Load(len(flat), wall, flat, server, own_cpu_seconds() - own0)


def fmt_rate(ops_per_s: float) -> str:
    return f"{ops_per_s:,.0f}"


def fmt_pct(frac: float) -> str:
    return f"{100 * frac:.0f}%"
