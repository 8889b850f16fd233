"""An inproc caller whose loop is held (synchronous work) past engine.handshake_timeout_s while
its first write's link is in its handshake: does the write fail though the daemon answered in time?"""
import asyncio, os, sys, time
sys.path.insert(0, os.getcwd())
import numpy as np
from benchmarks.engine_common import sides, start_pair
from benchmarks.harness import Options, Pinning
from client import Client
s = sides(Options(quick=False, pinning=Pinning.detect(enabled=False), verbose=False))
a, b = start_pair(s)
async def main():
    cb = await Client.connect(b.url)
    me = await Client.connect("inproc://")
    arr = np.zeros(1 << 16, np.uint8)
    mr, _ = await me.reg_mr(await me.register_memory(arr))
    _, desc = await cb.reg_mr(await cb.alloc_buffer(1 << 16))
    c = await me.submit_single_write(4096, None, (mr, 0), (desc, 0))
    await asyncio.sleep(float(sys.argv[2]))
    time.sleep(float(sys.argv[1]))  # the caller's own synchronous work holds the loop
    try:
        await c
        print("write ok")
    except Exception as exc:
        print("write failed:", exc)
        await asyncio.sleep(0.5); c2 = await me.submit_single_write(4096, None, (mr, 0), (desc, 0)); await c2; print("next write ok")
    await me.close(); await cb.close()
try:
    asyncio.run(main())
finally:
    a.stop(); b.stop()
