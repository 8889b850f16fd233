"""A 64-page paged write (the KV layer) between two inproc engines: time and CPU per write.

Two processes, each holding its engine in process (``inproc://``): B (CPU 1) registers a
cache and expects each write's immediate; A (CPU 0) submits N paged writes of PAGES
pages of 16 KiB at random indices, one at a time, and waits for each to be acknowledged.
Prints per write: p50 of submit -> acked, of the submit call alone, and CPU per write of
each process (its threads' user + system, from getrusage).  ``PROF=1``: cProfile with
the thread's CPU clock in both processes, the top of each by own time (counts per write
are what to read).  ``STEPS=1``: both processes stamped on one clock (A's flush, B's
wake-ups, receives, landing and expectation).  ``WATCHER=1``: a UVM watcher on A beside
the writes (with ``TRANSFERD_ENGINE_WATCHER_IDLE_POLL_MS=0.05`` it is polled every 50 us,
as the KV prefill's is).  ``PAGES`` (64): pages per write.  ``TREE=/path`` runs that
checkout.

    TREE=/work/wt/work STEPS=1 .venv/bin/python docs/probes/kv_paged.py [N]
"""

import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import time

ROOT = os.environ.get("TREE", os.getcwd())
sys.path.insert(0, ROOT)
N = int(sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] in "AB" else
        (sys.argv[1] if len(sys.argv) > 1 else 2000))
PAGES = int(os.environ.get("PAGES", "64"))
PAGE = 16 << 10
POOL = 4096
IMM = 0x4B560000


def cpus() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def profiled(name: str):
    if not os.environ.get("PROF"):
        return None
    import cProfile

    p = cProfile.Profile(time.thread_time)
    p.enable()
    return p


def dump(p, name: str) -> None:
    if p is None:
        return
    import pstats

    p.disable()
    path = f"/tmp/td-probe-kv-{name}.pstats"
    p.dump_stats(path)
    print(f"===== {name}", file=sys.stderr)
    pstats.Stats(path, stream=sys.stderr).sort_stats("tottime").print_stats(30)


STAMPS: list[tuple[str, int]] = []


def stamp_b() -> None:
    """STEPS=1: B's WRITE opened, finished (landed), and each receive, stamped."""
    from transferd.domains import link_io
    from transferd.protocol import peer_inbound

    ib = peer_inbound.InboundLink
    o_open, o_fin = ib._open_write, ib._finish
    clock, add = time.monotonic_ns, STAMPS.append

    def open_write(self, *a):
        add(("open", clock()))
        return o_open(self, *a)

    def finish(self):
        add(("landed", clock()))
        return o_fin(self)

    ib._open_write, ib._finish = open_write, finish
    o_recv = ib.received

    def received(self, n, now):
        add((f"rcv{n}", clock()))
        return o_recv(self, n, now)

    ib.received = received
    o_read = link_io.SocketLink._readable

    def readable(self):
        add(("readable", clock()))
        return o_read(self)

    link_io.SocketLink._readable = readable


def steps_of(fired: list[int]) -> dict:
    """Per write (matched by order): open -> landed, landed -> expectation fired, and
    readable wake-ups from open to landed."""
    opens = [t for k, t in STAMPS if k == "open"]
    lands = [t for k, t in STAMPS if k == "landed"]
    reads = [t for k, t in STAMPS if k == "readable"]
    n = min(len(opens), len(lands), len(fired))
    land, fire, wakes = [], [], []
    import bisect
    for i in range(n):
        # From the wake-up that brought the header (the last before it opened).
        j = bisect.bisect(reads, opens[i]) - 1
        land.append((lands[i] - (reads[j] if j >= 0 else opens[i])) / 1e3)
        fire.append((fired[i] - lands[i]) / 1e3)
        wakes.append(bisect.bisect(reads, lands[i]) - bisect.bisect(reads, opens[i]))
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else 0
    return {"open_landed": med(land), "landed_fired": med(fire), "wakes": med(wakes),
            "wakes_mean": sum(wakes) / max(1, len(wakes))}


async def side_b() -> None:
    from client import Client

    if os.environ.get("STEPS"):
        stamp_b()

    c = await Client.connect("inproc://")
    buf = await c.alloc_buffer(POOL * PAGE)
    _, desc = await c.reg_mr(buf)
    print(json.dumps({"desc": desc.to_bytes().hex()}), flush=True)
    prof = profiled("B")
    c0, s0 = cpus()
    fired = []
    for _ in range(N + 50):
        w = await c.expect_imm_count(IMM, PAGES, wait=False, timeout=30)
        await w
        fired.append(time.monotonic_ns())
    c1, s1 = cpus()
    dump(prof, "B")
    steps = steps_of(fired) if STAMPS else {}
    if STAMPS:
        with open("/tmp/td-probe-kv-B.json", "w") as f:
            json.dump(STAMPS, f)
    print(json.dumps({"cpu": c1 - c0 + s1 - s0, "sys": s1 - s0, **steps}), flush=True)
    await c.close()


def stamp_a() -> None:
    """STEPS=1: A's flush of the link (the sendmsg) stamped before and after."""
    from transferd.domains import link_io

    o_flush = link_io.SocketLink.flush
    clock, add = time.monotonic_ns, STAMPS.append

    def flush(self):
        t = clock()
        o_flush(self)
        add(("flush", t))
        add(("flushed", clock()))

    link_io.SocketLink.flush = flush


async def side_a(desc_hex: str) -> dict:
    from client import Client, MrDesc, Pages

    if os.environ.get("STEPS"):
        stamp_a()

    c = await Client.connect("inproc://")
    buf = await c.alloc_buffer(POOL * PAGE)
    mr, _ = await c.reg_mr(buf)
    desc = MrDesc.from_bytes(bytes.fromhex(desc_hex))
    if os.environ.get("WATCHER"):
        # A UVM watcher beside the writes, as the KV prefill has (polled every 50 us).
        await c.alloc_uvm_watcher(lambda old, new: None)
    rng = random.Random(1)
    plans = [(rng.sample(range(POOL), PAGES), rng.sample(range(POOL), PAGES))
             for _ in range(64)]
    clock = time.monotonic_ns

    async def one(i: int) -> tuple[int, int, int]:
        src, dst = plans[i % len(plans)]
        t0 = clock()
        done = await c.submit_paged_writes(PAGE, IMM, (mr, Pages(src, PAGE)),
                                           (desc, Pages(dst, PAGE)))
        t1 = clock()
        await done
        return t0, t1, clock()

    for i in range(50):
        await one(i)
        await asyncio.sleep(0.0005)
    prof = profiled("A")
    c0, s0 = cpus()
    out = []
    for i in range(N):
        out.append(await one(i))
        await asyncio.sleep(0.0005)  # a quiet gap, as between two layers
    c1, s1 = cpus()
    dump(prof, "A")
    await c.close()
    total = sorted((e - s) / 1e3 for s, _, e in out)
    call = sorted((m - s) / 1e3 for s, m, _ in out)
    res = {"p50": total[len(total) // 2], "call": call[len(call) // 2],
           "cpu": c1 - c0 + s1 - s0, "sys": s1 - s0}
    if STAMPS:
        import bisect
        fl = [t for k, t in STAMPS if k == "flush"]
        fd = [t for k, t in STAMPS if k == "flushed"]
        before, inside = [], []
        for s0_, _, _ in out:
            j = bisect.bisect(fl, s0_)
            if j < len(fl):
                before.append((fl[j] - s0_) / 1e3)
                inside.append((fd[j] - fl[j]) / 1e3)
        med = lambda xs: sorted(xs)[len(xs) // 2]
        res.update(to_flush=med(before), flush=med(inside))
        with open("/tmp/td-probe-kv-A.json", "w") as f:
            json.dump(STAMPS, f)
    return res


def cross() -> str:
    """A's flush against B's wake-up and landing, per write (one clock for both)."""
    import bisect

    with open("/tmp/td-probe-kv-A.json") as fa, open("/tmp/td-probe-kv-B.json") as fb:
        a, b = json.load(fa), json.load(fb)
    fl = [t for k, t in a if k == "flush"]
    fd = [t for k, t in a if k == "flushed"]
    wake = [t for k, t in b if k == "readable"]
    land = [t for k, t in b if k == "landed"]
    w, d, l_ = [], [], []
    for f, e in zip(fl, fd, strict=True):
        i, j = bisect.bisect(wake, f), bisect.bisect(land, f)
        if i < len(wake) and j < len(land):
            w.append((wake[i] - f) / 1e3)
            l_.append((land[j] - f) / 1e3)
            d.append((e - f) / 1e3)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return (f"since A's flush began: B woken {med(w):.0f} us, A's flush done {med(d):.0f} us,"
            f" B landed {med(l_):.0f} us")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "B":
        os.sched_setaffinity(0, {1})
        asyncio.run(side_b())
        return
    if len(sys.argv) > 1 and sys.argv[1] == "A":
        os.sched_setaffinity(0, {0})
        desc = sys.stdin.readline().strip()
        print(json.dumps(asyncio.run(side_a(desc))), flush=True)
        return
    env = {**os.environ, "TRANSFERD_ENGINE_HOST_RAILS": "127.0.0.1", "PYTHONPATH": ROOT}
    me = os.path.abspath(__file__)
    b = subprocess.Popen([sys.executable, me, "B", str(N)], stdout=subprocess.PIPE, env=env,
                         text=True, cwd=ROOT)
    desc = json.loads(b.stdout.readline())["desc"]
    a = subprocess.Popen([sys.executable, me, "A", str(N)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=env, text=True, cwd=ROOT)
    a.stdin.write(desc + "\n")
    a.stdin.flush()
    ra = json.loads(a.stdout.readline())
    rb = json.loads(b.stdout.readline())
    a.wait()
    b.wait()
    print(f"{os.path.basename(ROOT.rstrip('/'))}: {N} paged writes of {PAGES} x 16 KiB: "
          f"p50 {ra['p50']:.0f} us (submit call {ra['call']:.0f} us), CPU per write "
          f"A {ra['cpu'] / N * 1e6:.0f} us (sys {ra['sys'] / N * 1e6:.0f}), "
          f"B {rb['cpu'] / N * 1e6:.0f} us (sys {rb['sys'] / N * 1e6:.0f})")
    if "flush" in ra:
        print(f"  A: submit -> flush {ra['to_flush']:.0f} us, the flush (sendmsg) "
              f"{ra['flush']:.0f} us")
    if "flush" in ra and "wakes" in rb:
        print("  " + cross())
    if "wakes" in rb:
        print(f"  B: woken for the header -> landed {rb['open_landed']:.0f} us, landed -> "
              f"expectation fired {rb['landed_fired']:.0f} us, wake-ups per write {rb['wakes']} "
              f"(mean {rb['wakes_mean']:.2f})")


if __name__ == "__main__":
    main()
