"""UVM watchers: what idle ones cost the daemon, and how soon a change is seen (issue 16.9).

Two daemons side by side, the same code: ``adaptive`` (the default: polls every 50 us
while words change, then slows down to ``engine.watcher_idle_poll_ms``, 10 ms) and the
baseline ``fixed 50 us`` (``engine.watcher_idle_poll_ms = 0.05``: the pace never
drops, as every poll did before).  For each:

- the daemon's CPU time (utime + stime from /proc) over a fixed interval with no
  watcher, with one idle watcher, and with 4096 (64 connections of 64, the caps);
- the latency of a change, from the client's store into its mapped page to the
  callback on the client's loop (the EVENT's trip included): the first change after
  half a second of quiet, and changes 2 ms apart (a layer's pace).

Targets: one idle watcher under 1% of a core and 4096 under 5% (before: 12-19% and
84%); the first change after a quiet spell within the idle pace plus 5 ms; changes 2 ms
apart seen as fast as the baseline's (p50 within 0.5 ms of it).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from .harness import BenchResult, Check, Options, ServerProcess, Table, daemon_command, median
from .harness import percentile as pct

NAME = "watchers"
TITLE = "UVM watchers: CPU of idle watchers and change latency, adaptive vs fixed 50 us polling"
SECTION = "Security (issue 16)"

TICK = os.sysconf("SC_CLK_TCK")
ARMS = {"fixed 50 us": "0.05", "adaptive": ""}
PER_CONNECTION = 64
MANY = 4096


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def _cores(pid: int, seconds: float) -> float:
    c0, t0 = _cpu(pid), time.monotonic()
    await asyncio.sleep(seconds)
    return (_cpu(pid) - c0) / (time.monotonic() - t0)


async def _latency(w: Any, seen: asyncio.Queue[float], value: int) -> float:
    t0 = time.perf_counter()
    w.set(value)
    got = await asyncio.wait_for(seen.get(), 5)
    return got - t0


async def _bench(d: ServerProcess, opts: Options) -> dict[str, Any]:
    from client import Client

    out: dict[str, Any] = {}
    interval = opts.pick(5.0, 2.0)
    out["none"] = await _cores(d.pid, interval)
    seen: asyncio.Queue[float] = asyncio.Queue()
    first = await Client.connect(d.url)
    clients = [first]
    try:
        w = await first.alloc_uvm_watcher(lambda old, new: seen.put_nowait(time.perf_counter()))
        await asyncio.sleep(0.5)
        out["one"] = await _cores(d.pid, interval)
        value = 0
        idle: list[float] = []
        for _ in range(opts.pick(12, 4)):
            await asyncio.sleep(0.5)  # quiet: the poller has slowed down
            value += 1
            idle.append(await _latency(w, seen, value))
        busy: list[float] = []
        for _ in range(opts.pick(300, 60)):
            await asyncio.sleep(0.002)
            value += 1
            busy.append(await _latency(w, seen, value))
        out["idle_latency"], out["busy_latency"] = idle, busy
        many = MANY if not opts.quick else MANY // 4
        have = 1
        while have < many:
            c = clients[-1]
            if have % PER_CONNECTION == 0:
                c = await Client.connect(d.url)
                clients.append(c)
            await c.alloc_uvm_watcher(lambda old, new: None)
            have += 1
        await asyncio.sleep(0.5)
        out["many_count"] = have
        out["many"] = await _cores(d.pid, interval)
    finally:
        for c in clients:
            await c.close()
    return out


def run(opts: Options) -> BenchResult:
    import uvloop

    res = BenchResult(NAME, TITLE, SECTION)
    got: dict[str, dict[str, Any]] = {}
    for arm, idle in ARMS.items():
        env = {"TRANSFERD_ENGINE_WATCHER_IDLE_POLL_MS": idle} if idle else {}
        with ServerProcess(daemon_command(), opts.pinning, name=f"daemon ({arm})",
                           env=env) as d:
            got[arm] = uvloop.run(_bench(d, opts))
        opts.log(f"{arm}: {got[arm]}")
    table = Table("daemon CPU (cores) while its watchers are idle, and change latency "
                  "(client store to callback)",
                  ["arm", "no watcher", "1 idle", f"{got['adaptive']['many_count']} idle",
                   "first after 0.5 s quiet p50 / max ms", "2 ms apart p50 / p99 ms"])
    for arm, g in got.items():
        table.add(arm, f"{g['none']:.3f}", f"{g['one']:.3f}", f"{g['many']:.3f}",
                  f"{median(g['idle_latency']) * 1e3:.2f} / {max(g['idle_latency']) * 1e3:.2f}",
                  f"{median(g['busy_latency']) * 1e3:.2f} / "
                  f"{pct(g['busy_latency'], 99) * 1e3:.2f}")
    res.tables.append(table)
    a, f = got["adaptive"], got["fixed 50 us"]
    res.checks += [
        Check("1 idle watcher, cores", a["one"], "<=", 0.01),
        Check(f"{a['many_count']} idle watchers, cores", a["many"], "<=", 0.05),
        Check("1 idle watcher, adaptive / fixed", a["one"] / max(f["one"], 1e-9), "<=", 0.2,
              "x"),
        Check("first change after quiet, max ms", max(a["idle_latency"]) * 1e3, "<=", 15.0),
        Check("changes 2 ms apart, p50 over the baseline's, ms",
              (median(a["busy_latency"]) - median(f["busy_latency"])) * 1e3, "<=", 0.5),
    ]
    res.notes.append("the same code in both arms; the baseline never slows its polls "
                     "(engine.watcher_idle_poll_ms = 0.05), as every poll did before issue 16")
    res.data = got
    return res
