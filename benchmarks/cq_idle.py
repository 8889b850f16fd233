"""The completion-queue loop idle and waking, without a device (issue 24, item 4).

One CqPoller per path on a recorded-completion stand-in (tests/verbs_standins.py: a
completion queue fed by the benchmark, its channel a real eventfd that becomes readable
once per armed completion, as the kernel's does): **channel fd**, what the loop does
wherever the completion channel's descriptor is found (pyverbs >= 57's
``CompChannel.fd``, or /proc/self/fd with pyverbs 44), against the baseline **timer**,
what pyverbs 44 got before (a 200 us busy-poll burst every millisecond).  Measured in
the same run: the loop thread's CPU while idle (``time.thread_time``), and the delay from
a completion (recorded from another thread, at random moments) to its dispatch.
Target: under 1% of a core per NIC while idle.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time

from tests.verbs_standins import Channel, RecordedCq
from transferd.rdma.completions import Completion, WrKind, wr_id
from transferd.rdma.constants import WcOpcode, WcStatus
from transferd.rdma.cqloop import CqPoller

from .harness import BenchResult, Check, Options, Table

NAME = "cq_idle"
TITLE = "completion-queue loop: idle CPU and wake-up delay, channel fd vs timer"
SECTION = "RDMA completion queue (issue 24)"


def _measure(use_fd: bool, idle_s: float, wakeups: int) -> dict[str, float]:
    loop = asyncio.new_event_loop()
    channel = Channel()
    cq = RecordedCq(channel)
    cq.req_notify()
    delays: list[float] = []
    sent: dict[int, float] = {}

    def got(c: Completion) -> None:
        delays.append(time.perf_counter() - sent.pop(c.wr_id))

    def record(c: Completion) -> None:
        # On the loop's thread, as the NIC writes the queue (the stand-in is not
        # thread-safe); the delay counts from the moment it is recorded.
        sent[c.wr_id] = time.perf_counter()
        cq.complete(c)

    poller = CqPoller(loop, cq, channel, got, fd=channel.efd if use_fd else None)
    try:
        cpu0 = time.thread_time()
        loop.run_until_complete(asyncio.sleep(idle_s))
        idle_cpu = time.thread_time() - cpu0
        polls = poller.polls
        rng = random.Random(7)

        def feed() -> None:
            for i in range(wakeups):
                time.sleep(rng.uniform(0.002, 0.006))
                c = Completion(wr_id(WrKind.RECV, i), WcStatus.SUCCESS, WcOpcode.RECV, 5, 64)
                loop.call_soon_threadsafe(record, c)

        feeder = threading.Thread(target=feed)
        feeder.start()

        async def until_done() -> None:
            while len(delays) < wakeups:
                await asyncio.sleep(0.01)

        loop.run_until_complete(asyncio.wait_for(until_done(), 30))
        feeder.join()
    finally:
        poller.close()
        channel.close()
        loop.close()
    return {"idle_cpu_pct": idle_cpu / idle_s * 100, "idle_polls": polls,
            "wake_p50_us": statistics.median(delays) * 1e6,
            "wake_max_us": max(delays) * 1e6}


def run(opts: Options) -> BenchResult:
    res = BenchResult(NAME, TITLE, SECTION)
    idle_s = 0.5 if opts.quick else 3.0
    wakeups = 50 if opts.quick else 300
    rows = {"timer (baseline)": _measure(False, idle_s, wakeups),
            "channel fd": _measure(True, idle_s, wakeups)}
    t = Table(f"one NIC's completion-queue loop, {idle_s:g} s idle, then {wakeups} "
              "completions at random moments",
              ["path", "idle CPU % of a core", "ibv_poll_cq calls idle", "wake p50 us",
               "wake max us"])
    for name, r in rows.items():
        t.add(name, f"{r['idle_cpu_pct']:.3f}", f"{r['idle_polls']:,.0f}",
              f"{r['wake_p50_us']:.0f}", f"{r['wake_max_us']:.0f}")
    res.tables.append(t)
    fd, timer = rows["channel fd"], rows["timer (baseline)"]
    res.checks.append(Check("idle CPU per NIC, channel fd", fd["idle_cpu_pct"], "<=", 1.0,
                            "%"))
    res.notes.append(f"idle CPU: channel fd / timer = "
                     f"{fd['idle_cpu_pct'] / max(timer['idle_cpu_pct'], 1e-9):.4f}")
    res.data = rows
    return res
