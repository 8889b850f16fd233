# per-row client costs, in process, against a real daemon (only queueing timed separately)
import os, sys, time, asyncio
ROOT = os.environ["TREE"]; sys.path.insert(0, ROOT); os.chdir(ROOT)
from benchmarks.harness import ServerProcess, daemon_command, Pinning
allowed = frozenset(os.sched_getaffinity(0))
d = ServerProcess(daemon_command(), Pinning(frozenset({0}), frozenset({1}), allowed), name="d").start()
os.sched_setaffinity(0, {1})
S = int(os.environ.get("S", "4")); K = 32
async def main():
    from client import Client
    c = await Client.connect(d.url)
    buf = await c.alloc_buffer(4096 * 256)
    ts = [buf.tensor(i * S, S) for i in range(K)]
    data = b"y" * S
    tt = time.thread_time
    res = {}
    for rep in range(5):
        # queue only
        q = 0.0; fl = 0.0; whole = 0.0
        for _ in range(300):
            t0 = tt()
            for x in ts: c.set_tensor_async(x, data)
            fs = [c.get_tensor_async(x) for x in ts]
            t1 = tt()
            await c.flush()
            t2 = tt()
            q += t1 - t0; fl += t2 - t1
        res.setdefault("queue", []).append(q / 300 / K * 1e6)
        a = b = 0.0
        for _ in range(300):
            t0 = tt()
            for x in ts: c.set_tensor_async(x, data)
            t1 = tt()
            fs = [c.get_tensor_async(x) for x in ts]
            t2 = tt()
            a += t1 - t0; b += t2 - t1
            await c.flush()
        res.setdefault("set_async", []).append(a / 300 / K * 1e6)
        res.setdefault("get_async", []).append(b / 300 / K * 1e6)
        lp = asyncio.get_running_loop()
        t0 = tt()
        for _ in range(300):
            fs = [lp.create_future() for x in ts]
        res.setdefault("bare create_future", []).append((tt() - t0) / 300 / K * 1e6)
        res.setdefault("flush", []).append(fl / 300 * 1e6)
        one = 0.0
        for _ in range(300):
            t0 = tt()
            c.set_tensor_async(ts[0], data); f = c.get_tensor_async(ts[0])
            await c.flush()
            one += tt() - t0
        res.setdefault("flush1", []).append(one / 300 * 1e6)
    import resource
    for n in (1, K):
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        for _ in range(2000):
            for x in ts[:n]: c.set_tensor_async(x, data)
            fs = [c.get_tensor_async(x) for x in ts[:n]]
            await c.flush()
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        print(f"N={n} step: client user {(r1.ru_utime-r0.ru_utime)/2000*1e6:.1f} us sys {(r1.ru_stime-r0.ru_stime)/2000*1e6:.1f} us")
    for k, v in res.items(): print(k, f"min {min(v):.2f} med {sorted(v)[2]:.2f} us")
    await c.close()
import uvloop
uvloop.run(main()); d.stop()
