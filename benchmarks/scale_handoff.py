"""(4, hand-off) What it costs to hand a 4 KiB write's descriptor to a worker and back.

The engine's write crosses from the daemon's loop to a worker and back.  This figure
measures that crossing alone, for the designs a domain group's worker could have, with
the same 40-byte descriptor (op id, region, offset, length of a 4 KiB write into a
shared 1 MiB region, and an amount of Python work) and the same check on the worker's
side (bounds, then the first and last byte of the 4 KiB read where they lie):

- ``direct call``: the worker's handler called as a function on the loop (the floor);
- ``same loop``: ``loop.call_soon`` of the handler, which resolves a future the caller
  awaits (a worker coroutine on the daemon's own loop: one loop turn);
- ``thread``: the handler on a worker thread's own uvloop, reached with
  ``call_soon_threadsafe`` and answering with ``call_soon_threadsafe`` back (today's
  worker thread: two wake-ups, and the thread shares the interpreter lock);
- ``process``: a worker process (its own interpreter, no shared lock) that maps the
  same memfd region, the descriptor sent over a ``socketpair`` (SOCK_SEQPACKET) read by
  its uvloop, the 16-byte completion sent back and read by the caller's loop.

Each is measured with the worker on the caller's CPU and on the other CPU where there
are two: a round trip at a time (p50 and p99 of ``n``), and the rate with 64
descriptors in flight (batched wake-ups; the process variant sends them in one
message each way).  Alternating rounds; medians over rounds.

The interpreter lock: the same loop, a thread and a process on the other CPU again,
now with ``WORK_US`` of Python work per write on each side (the worker's per write, the
caller's per completion, two batches of 64 in flight so the sides can overlap).  A
thread shares the caller's interpreter lock, so both halves run one after the other;
a process runs its half beside the caller's.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .harness import REPO, BenchResult, Options, Table, clean_env, fmt_us, median, percentile
from .scale_common import SECTION

NAME = "scale_handoff"
TITLE = "(4) hand-off of a 4 KiB write descriptor: same loop, thread, process (shared memfd)"
SECTION = SECTION

DESC = struct.Struct("<QQQQQ")  # op, region, offset, length, work (spin iterations)
DONE = struct.Struct("<QQQ")  # op, status, the worker's CPU ns for the work
REGION = 1 << 20
SIZE = 4096
INFLIGHT = 64
# Python work per write on each side in the lock figure (microseconds of a loop).
WORK_US = 20


def spin(n: int) -> None:
    """Python work standing in for a side's per-write Python (``n`` loop turns)."""
    for _ in range(n):
        pass


def spins_per_us() -> float:
    n = 200_000
    best = min(_timed_spin(n) for _ in range(5))
    return n / (best * 1e6)


def _timed_spin(n: int) -> float:
    t0 = time.perf_counter()
    spin(n)
    return time.perf_counter() - t0


def check(mem: memoryview, raw: bytes | memoryview, at: int = 0) -> tuple[int, int, int]:
    """The worker's side: parse, bounds-check, read the first and last byte, do the
    descriptor's Python work; (op, status, CPU ns the work took: this thread's own time,
    not time spent waiting for a CPU or the interpreter lock)."""
    op, _region, off, length, work = DESC.unpack_from(raw, at)
    spent = 0
    if work:
        t0 = time.thread_time_ns()
        spin(work)
        spent = time.thread_time_ns() - t0
    if off + length > len(mem) or length == 0:
        return op, 1, spent
    return op, 0 if mem[off] == mem[off + length - 1] else 2, spent


# -- arms -----------------------------------------------------------------------


class SameLoop:
    def __init__(self, mem: memoryview) -> None:
        self.mem = mem
        self.loop = asyncio.get_running_loop()
        self.worker_ns = 0

    def _handle(self, raw: bytes, fut: asyncio.Future[int]) -> None:
        _, status, spent = check(self.mem, raw)
        self.worker_ns += spent
        fut.set_result(status)

    def submit(self, raw: bytes) -> asyncio.Future[int]:
        fut = self.loop.create_future()
        self.loop.call_soon(self._handle, raw, fut)
        return fut

    def close(self) -> None:
        pass


class ThreadWorker:
    def __init__(self, mem: memoryview, cpu: int | None) -> None:
        import uvloop

        self.mem = mem
        self.loop = asyncio.get_running_loop()
        self.worker_ns = 0
        self.wloop = uvloop.new_event_loop()
        self.cpu = cpu
        self.thread = threading.Thread(target=self._run, name="handoff-worker", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.cpu is not None:
            os.sched_setaffinity(0, {self.cpu})  # this thread only
        asyncio.set_event_loop(self.wloop)
        self.wloop.run_forever()

    def _handle(self, raw: bytes, fut: asyncio.Future[int]) -> None:
        _, status, spent = check(self.mem, raw)
        self.worker_ns += spent  # this thread alone writes it
        self.loop.call_soon_threadsafe(fut.set_result, status)

    def submit(self, raw: bytes) -> asyncio.Future[int]:
        fut = self.loop.create_future()
        self.wloop.call_soon_threadsafe(self._handle, raw, fut)
        return fut

    def close(self) -> None:
        self.wloop.call_soon_threadsafe(self.wloop.stop)
        self.thread.join(5)
        self.wloop.close()


class ProcessWorker:
    """A worker process over a socketpair; the region is a memfd both map."""

    def __init__(self, memfd: int, cpu: int | None) -> None:
        self.loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.sock.setblocking(False)
        pre = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scale_handoff", "worker", "--sock",
             str(theirs.fileno()), "--memfd", str(memfd)],
            pass_fds=(theirs.fileno(), memfd), cwd=REPO, env=clean_env(), preexec_fn=pre,
            stdout=subprocess.PIPE)
        theirs.close()
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the hand-off worker process did not start")
        self.waiting: dict[int, asyncio.Future[int]] = {}
        self.worker_ns = 0
        self.ops = 0
        self.loop.add_reader(self.sock.fileno(), self._readable)

    def _readable(self) -> None:
        for _ in range(64):
            try:
                data = self.sock.recv(DONE.size * INFLIGHT)
            except BlockingIOError:
                return
            for at in range(0, len(data), DONE.size):
                op, status, spent = DONE.unpack_from(data, at)
                self.worker_ns += spent
                fut = self.waiting.pop(op, None)
                if fut is not None:
                    fut.set_result(status)

    def submit(self, raw: bytes) -> asyncio.Future[int]:
        return self.submit_many([raw])[0]

    def submit_many(self, raws: list[bytes]) -> list[asyncio.Future[int]]:
        futs = []
        for raw in raws:
            fut = self.loop.create_future()
            self.waiting[DESC.unpack_from(raw)[0]] = fut
            futs.append(fut)
        self.sock.send(b"".join(raws))
        return futs

    def close(self) -> None:
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def worker_main(sock_fd: int, memfd: int) -> None:
    """The worker process: descriptors in, completions out, on its own uvloop."""
    import uvloop

    mem = memoryview(mmap.mmap(memfd, REGION))
    sock = socket.socket(fileno=sock_fd)
    sock.setblocking(False)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        closed = loop.create_future()

        def readable() -> None:
            for _ in range(64):
                try:
                    data = sock.recv(DESC.size * INFLIGHT)
                except BlockingIOError:
                    return
                if not data:
                    loop.remove_reader(sock.fileno())
                    closed.set_result(None)
                    return
                out = b"".join(DONE.pack(*check(mem, data, at))
                               for at in range(0, len(data), DESC.size))
                sock.send(out)

        loop.add_reader(sock.fileno(), readable)
        print("ready", flush=True)
        await closed

    uvloop.run(serve())


# -- measurement ------------------------------------------------------------------


async def _round_trips(submit: Callable[[bytes], Awaitable[int]], descs: list[bytes]
                       ) -> list[float]:
    clock = time.perf_counter
    out = []
    for raw in descs:
        t0 = clock()
        if await submit(raw):
            raise AssertionError("the worker refused a good descriptor")
        out.append(clock() - t0)
    return out


async def _rate(arm: Any, descs: list[bytes], batches: int) -> float:
    t0 = time.perf_counter()
    for b in range(batches):
        chunk = descs[(b * INFLIGHT) % len(descs):][:INFLIGHT]
        many = getattr(arm, "submit_many", None)
        futs = many(chunk) if many is not None else [arm.submit(r) for r in chunk]
        if any(await asyncio.gather(*futs)):
            raise AssertionError("the worker refused a good descriptor")
    return batches * INFLIGHT / (time.perf_counter() - t0)


async def _rate_work(arm: Any, descs: list[bytes], batches: int, work: int
                     ) -> tuple[float, float]:
    """Writes with Python work on both sides: the worker's in each descriptor, the caller's
    for each completion; two batches in flight, so the two sides can overlap.
    Returns the rate and the CPU seconds both sides' work took per write (each thread's
    own CPU time: on a shared machine a CPU's speed for us changes from minute to minute,
    and waiting for a CPU or the lock is not work)."""
    many = getattr(arm, "submit_many", None)

    def submit(b: int) -> list[asyncio.Future[int]]:
        chunk = descs[(b * INFLIGHT) % len(descs):][:INFLIGHT]
        return many(chunk) if many is not None else [arm.submit(r) for r in chunk]

    clock = time.perf_counter
    spun = 0
    worker0 = arm.worker_ns
    t0 = clock()
    pending = submit(0)
    for b in range(1, batches + 1):
        nxt = submit(b) if b < batches else []
        if any(await asyncio.gather(*pending)):
            raise AssertionError("the worker refused a good descriptor")
        s0 = time.thread_time_ns()
        spin(work * len(pending))  # the caller's own Python for what completed
        spun += time.thread_time_ns() - s0
        pending = nxt
    wall = clock() - t0
    writes = batches * INFLIGHT
    # Both halves' CPU time per write: what one interpreter would run one after the other.
    return writes / wall, (spun + arm.worker_ns - worker0) / 1e9 / writes


async def _measure(opts: Options, n: int | None) -> dict[str, Any]:
    n = n or opts.pick(3000, 1000)
    rounds = opts.pick(3, 2)
    batches = opts.pick(400, 50)
    memfd = os.memfd_create("transferd-handoff")
    os.ftruncate(memfd, REGION)
    region = mmap.mmap(memfd, REGION)
    mem = memoryview(region)
    mem[:] = bytes([0x5A]) * REGION
    here = os.sched_getaffinity(0)
    cpu = min(here)
    allowed = sorted(opts.pinning.allowed)
    other = next((c for c in allowed if c != cpu), None)
    arms: dict[str, Any] = {"same loop": SameLoop(mem),
                            "thread, same CPU": ThreadWorker(mem, cpu),
                            "process, same CPU": ProcessWorker(memfd, cpu)}
    if other is not None:
        arms["thread, other CPU"] = ThreadWorker(mem, other)
        arms["process, other CPU"] = ProcessWorker(memfd, other)
    op = iter(range(1, 1 << 62))
    try:
        def descs(k: int, work: int = 0) -> list[bytes]:
            return [DESC.pack(next(op), 1, (i * SIZE) % REGION, SIZE, work) for i in range(k)]

        direct = []
        for _ in range(rounds):
            ds = descs(n)
            t0 = time.perf_counter()
            for raw in ds:
                check(mem, raw)
            direct.append((time.perf_counter() - t0) / n)
        for arm in arms.values():  # warm
            await _round_trips(arm.submit, descs(200))
        per: dict[str, dict[str, list[float]]] = {
            k: {"p50": [], "p99": [], "rate": []} for k in arms}
        for r in range(rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for name in order:
                arm = arms[name]
                xs = await _round_trips(arm.submit, descs(n))
                per[name]["p50"].append(percentile(xs, 50))
                per[name]["p99"].append(percentile(xs, 99))
                per[name]["rate"].append(await _rate(arm, descs(INFLIGHT * 4), batches))
                opts.log(f"round {r} {name}: p50 {fmt_us(per[name]['p50'][-1])} us")
        # The interpreter lock: Python work on both sides, a worker on the other CPU.
        work = max(1, round(WORK_US * spins_per_us()))
        loaded = [k for k in ("same loop", "thread, other CPU", "process, other CPU")
                  if k in arms]
        with_work: dict[str, list[float]] = {k: [] for k in loaded}
        overlap: dict[str, list[float]] = {k: [] for k in loaded}
        for r in range(rounds):
            for name in loaded if r % 2 == 0 else list(reversed(loaded)):
                rate, both = await _rate_work(arms[name], descs(INFLIGHT * 4, work),
                                              batches // 2, work)
                with_work[name].append(rate)
                # 1.0: the two halves one after the other, as fast as timed; above: overlap.
                overlap[name].append(rate * both)
    finally:
        for arm in arms.values():
            arm.close()
        arms.clear()
        mem.release()
        region.close()
        os.close(memfd)
    return {"n": n, "rounds": rounds, "batches": batches, "direct_s": median(direct),
            "per": per, "cpu": cpu, "other": other, "work_us": WORK_US, "work_spins": work,
            "with_work": with_work, "overlap": overlap}


def run(opts: Options, n: int | None = None) -> BenchResult:
    """The figure; fewer round trips (``n``) per round for a smaller one."""
    import uvloop

    res = BenchResult(NAME, TITLE, SECTION)
    before = os.sched_getaffinity(0)
    if opts.pinning.server is not None:
        os.sched_setaffinity(0, opts.pinning.server)  # where a daemon's loop runs
    try:
        m = uvloop.run(_measure(opts, n))
    finally:
        os.sched_setaffinity(0, before)
    t = Table(f"hand-off of a 40-byte descriptor of a 4 KiB write and its completion back, "
              f"{m['rounds']} alternating rounds x {m['n']} round trips "
              f"(+ {m['batches']} batches of {INFLIGHT} in flight)",
              ["design", "round trip p50 us", "p99 us", "vs same loop p50",
               f"hand-offs/s, {INFLIGHT} in flight"])
    t.add("direct call (the floor)", f"{m['direct_s'] * 1e6:.2f}", "", "", "")
    summary: dict[str, Any] = {"direct_call_s": m["direct_s"]}
    base = median(m["per"]["same loop"]["p50"])
    for name, v in m["per"].items():
        p50, p99, rate = median(v["p50"]), median(v["p99"]), median(v["rate"])
        t.add(name, fmt_us(p50), fmt_us(p99), f"{p50 / base:.1f}x", f"{rate:,.0f}")
        summary[name] = {"p50_s": p50, "p99_s": p99, "rate_per_s": rate}
    res.tables.append(t)
    ww = m["with_work"]
    if ww:
        lt = Table(f"the interpreter lock: {m['work_us']} us of Python per write on each side "
                   f"(the worker's and the caller's), {INFLIGHT} x 2 in flight, "
                   f"{m['rounds']} alternating rounds",
                   ["design", "writes/s", "vs same loop", "vs both halves in series"])
        one = median(ww["same loop"])
        for name, xs in ww.items():
            ov = median(m["overlap"][name])
            lt.add(name, f"{median(xs):,.0f}", f"{median(xs) / one:.2f}x", f"{ov:.2f}x")
            summary[f"{name} with work"] = {"rate_per_s": median(xs), "vs_series": ov}
        res.tables.append(lt)
        res.notes.append(
            "vs both halves in series = the rate x both sides' CPU time for the work per write "
            "(each thread's own CPU time, measured in that measurement): 1.00x is one "
            "interpreter running both halves one after the other; a worker process runs its "
            "half beside the caller's, on its own CPU and interpreter, so it can reach 2x "
            "where that CPU is free")
    res.notes.append(
        f"the caller's loop on CPU {m['cpu']} (the servers' CPU); 'other CPU' workers on CPU "
        f"{m['other']}; the process worker maps the same memfd region (the 4 KiB never "
        "crosses, only the descriptor) and talks over an AF_UNIX SOCK_SEQPACKET socketpair")
    res.data = {"summary": summary, **m}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scale_handoff")
    ap.add_argument("role", choices=["worker"])
    ap.add_argument("--sock", type=int, required=True)
    ap.add_argument("--memfd", type=int, required=True)
    a = ap.parse_args(argv)
    worker_main(a.sock, a.memfd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
