"""cProfile (CPU clock) of N sequential 4 KiB inproc -> daemon writes; calls per write."""
import asyncio, cProfile, gc, os, pstats, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np, uvloop
from benchmarks.engine_common import sides, start_pair, client_on
from benchmarks.harness import Options, Pinning
from client import Client
N = int(os.environ.get("N", "2000"))
pin = Pinning.detect(enabled=True); s = sides(Options(quick=False, pinning=pin, verbose=False))
a, b = start_pair(s)
loop = uvloop.new_event_loop()
async def main():
    cb = await Client.connect(b.url)
    me = await Client.connect("inproc://")
    arr = np.zeros(1 << 20, np.uint8)
    src = await me.register_memory(arr)
    mr, _ = await me.reg_mr(src)
    dst = await cb.alloc_buffer(1 << 20)
    _, desc = await cb.reg_mr(dst)
    submit = me.submit_single_write
    async def lat(n):
        for _ in range(n):
            await (await submit(4096, None, (mr, 0), (desc, 0)))
    await lat(500)
    gc.disable()
    t0 = time.perf_counter(); c0 = time.process_time()
    await lat(N)
    t1 = time.perf_counter(); c1 = time.process_time()
    print(f"no profile: wall {(t1-t0)/N*1e6:.1f} us/write, this process CPU {(c1-c0)/N*1e6:.1f} us/write")
    bs = []
    for _ in range(int(os.environ.get("BATCHES", "0"))):
        c0 = time.thread_time(); await lat(250); bs.append((time.thread_time() - c0) / 250 * 1e6)
    if bs:
        bs.sort(); print(f"batches of 250: CPU us/write min {bs[0]:.1f} p25 {bs[len(bs)//4]:.1f} median {bs[len(bs)//2]:.1f}")
    if os.environ.get("PROF"):
        pr = cProfile.Profile(time.process_time)
        pr.enable(); await lat(N); pr.disable()
        pr.dump_stats(os.environ["PROF"])
    gc.enable()
    await me.close(); await cb.close()
try:
    with client_on(s.initiator):
        loop.run_until_complete(main())
finally:
    a.stop(); b.stop()
if os.environ.get("PROF"):
    st = pstats.Stats(os.environ["PROF"])
    tot = sum(v[1] for v in st.stats.values())
    print("primitive calls per write:", tot / N)
    st.sort_stats(os.environ.get("SORT", "tottime")).print_stats(int(os.environ.get("TOP", "45")))
