"""A/B in one process: the base client/inproc.py (loaded as client._inproc_base) and this tree's,
each with its own inproc node, writing 4 KiB to the same daemon B; batches alternate;
CPU (thread_time) per write, median of per-pair differences."""
import asyncio, gc, importlib.util, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np, uvloop
import client
from benchmarks.engine_common import sides, start_pair, client_on
from benchmarks.harness import Options, Pinning
from client import Client
spec = importlib.util.spec_from_file_location("client._inproc_base", "/tmp/inproc2/base/client/inproc.py")
base_mod = importlib.util.module_from_spec(spec); sys.modules["client._inproc_base"] = base_mod; spec.loader.exec_module(base_mod)
from client.inproc import InprocClient as New
Base = base_mod.InprocClient
s = sides(Options(quick=False, pinning=Pinning.detect(enabled=True), verbose=False))
a, b = start_pair(s)
loop = uvloop.new_event_loop()
B, PAIRS = int(os.environ.get("B", "200")), int(os.environ.get("PAIRS", "40"))
async def arm(cls, cb):
    me = await cls.connect("inproc://")
    arr = np.zeros(1 << 20, np.uint8)
    mr, _ = await me.reg_mr(await me.register_memory(arr))
    _, desc = await cb.reg_mr(await cb.alloc_buffer(1 << 20))
    submit = me.submit_single_write
    async def lat(n):
        for _ in range(n):
            await (await submit(4096, None, (mr, 0), (desc, 0)))
    return me, arr, lat
async def main():
    cb = await Client.connect(b.url)
    arms = {"base": await arm(Base, cb), "new": await arm(New, cb)}
    for k, (_, _, lat) in arms.items(): await lat(500)
    gc.disable()
    res = {k: [] for k in arms}; wall = {k: [] for k in arms}
    for i in range(PAIRS):
        for k in (("base", "new") if i % 2 == 0 else ("new", "base")):
            c0 = time.thread_time(); w0 = time.perf_counter()
            await arms[k][2](B)
            res[k].append((time.thread_time() - c0) / B * 1e6); wall[k].append((time.perf_counter() - w0) / B * 1e6)
    gc.enable()
    d = [n - o for n, o in zip(res["new"], res["base"])]
    for k in res:
        print(f"{k}: CPU us/write median {statistics.median(res[k]):.1f} min {min(res[k]):.1f}; wall median {statistics.median(wall[k]):.1f}")
    print(f"new - base per pair: median {statistics.median(d):+.2f} us/write  (p25 {sorted(d)[len(d)//4]:+.2f}, p75 {sorted(d)[3*len(d)//4]:+.2f})")
    for k in arms: await arms[k][0].close()
    await cb.close()
try:
    with client_on(s.initiator):
        loop.run_until_complete(main())
finally:
    a.stop(); b.stop()
