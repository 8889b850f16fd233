# Per row of a batched step, in process against this tree's daemon (TREE=): the client's
# set_tensor_async and get_tensor_async per row, and the flush of N=32 and N=1 (min of 7 x 300).
import os, sys, time, asyncio
ROOT = os.environ["TREE"]; sys.path.insert(0, ROOT); os.chdir(ROOT); os.environ["PYTHONPATH"] = ROOT
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
    pc = time.perf_counter
    R = {}
    for rep in range(7):
        a = b = fl = 0.0
        for _ in range(300):
            t0 = pc()
            for x in ts: c.set_tensor_async(x, data)
            t1 = pc()
            fs = [c.get_tensor_async(x) for x in ts]
            t2 = pc()
            await c.flush()
            t3 = pc()
            a += t1 - t0; b += t2 - t1; fl += t3-t2
        R.setdefault("set", []).append(a / 300 / K * 1e6)
        R.setdefault("get", []).append(b / 300 / K * 1e6)
        R.setdefault("flush32", []).append(fl / 300 * 1e6)
        one = 0.0
        for _ in range(300):
            c.set_tensor_async(ts[0], data); f = c.get_tensor_async(ts[0])
            t0 = pc()
            await c.flush()
            one += pc() - t0
        R.setdefault("flush1", []).append(one / 300 * 1e6)
    for k, v in R.items(): print(f"{k:8s} min {min(v):7.3f} med {sorted(v)[3]:7.3f} us")
    await c.close()
import uvloop
uvloop.run(main()); d.stop()
