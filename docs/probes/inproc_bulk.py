"""1 GiB write: inproc (caller array / node buffer) vs daemon path, rounds alternating, CPU of each process."""
import asyncio, os, sys, statistics, time, gc
sys.path.insert(0, os.getcwd())
import numpy as np, uvloop
from benchmarks.engine_common import sides, start_pair, client_on, GiB, MiB
from benchmarks.engine_inproc import Side
from benchmarks.harness import Options, Pinning
from benchmarks.scale_common import cpu_seconds
from client import Client

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
size = int(os.environ.get("SIZE", GiB))
pin = Pinning.detect(enabled=True); s = sides(Options(quick=False, pinning=pin, verbose=False))
a, b = start_pair(s)
loop = uvloop.new_event_loop()
me_pid = os.getpid()
E_PERF = os.environ.get('PERF')
gcstat = {}
_gct = [0.0]
def _cb(phase, info):
    if phase == "start": _gct[0] = time.perf_counter()
    else:
        g = info["generation"]; c = gcstat.setdefault(g, [0, 0.0]); c[0] += 1; c[1] += time.perf_counter() - _gct[0]
gc.callbacks.append(_cb)
extra = []
if os.environ.get("BASE"):
    from benchmarks.engine_common import start_peers
    pairs, _ = start_peers(("socket", "mooncake", "nixl"), MiB, s, print)
    extra += list(pairs.values())

async def setup():
    cb = await Client.connect(b.url)
    me = await Client.connect("inproc://")
    ca = await Client.connect(a.url)
    arms = {"inproc-own": Side(me, cb, [], size), "inproc-al": Side(me, cb, [], size),
            "daemon": Side(ca, cb, [], size)}
    for k, arm in arms.items():
        arm.peers = []
        await setup_side(arm, own={"inproc-own": 1, "inproc-al": 2}.get(k, 0))
    return arms, [me, ca, cb]

async def setup_side(self, own):
    import zlib
    big = self.big
    raw = bytearray(np.random.default_rng(21).bytes(big))
    data = np.frombuffer(raw, dtype=np.uint8)
    if own == 2:
        import mmap
        m = mmap.mmap(-1, big); mv = np.frombuffer(m, dtype=np.uint8); mv[:] = data; self._array = mv
        print("aligned addr mod 4096:", mv.ctypes.data % 4096)
        src = await self.c.register_memory(mv)
    elif own:
        self._array = data
        print("bytearray addr mod 4096:", data.ctypes.data % 4096)
        src = await self.c.register_memory(data)
    else:
        src = await self.c.alloc_buffer(big)
        for off in range(0, big, 64 * MiB):
            await self.c.set_tensor(src.tensor(off, min(64 * MiB, big - off)), data[off: off + 64 * MiB])
    self.src = src
    self.mr, _ = await self.c.reg_mr(src)
    self.dst = await self.cb.alloc_buffer(big)
    _, self.desc = await self.cb.reg_mr(self.dst)

try:
    with client_on(s.initiator):
        arms, clients = loop.run_until_complete(setup())
        names = [n for n in arms if not os.environ.get("ONLY") or n in os.environ["ONLY"].split(",")]
        for n in names:
            loop.run_until_complete(arms[n].bulk())
        t = {n: [] for n in names}; cpu = {n: [] for n in names}
        for r in range(rounds):
            for n in (names if r % 2 == 0 else names[::-1]):
                c0 = (cpu_seconds(me_pid), cpu_seconds(a.pid), cpu_seconds(b.pid))
                gcstat.clear()
                if os.environ.get("GCOFF"): gc.disable()
                if E_PERF:
                    import subprocess, signal
                    spid = me_pid if n != "daemon" else a.pid
                    perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "20000", "-o", f"/tmp/inproc2/perf-{n}-{r}.data", "-p", str(spid)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
                    time.sleep(0.2)
                t[n].append(loop.run_until_complete(arms[n].bulk()))
                if E_PERF:
                    perf.send_signal(signal.SIGINT); err = perf.communicate()[1]

                gc.enable()
                if os.environ.get("GCV"): print(n, "%.3f" % t[n][-1], {g: (c, round(x*1e3, 1)) for g, (c, x) in gcstat.items()})
                c1 = (cpu_seconds(me_pid), cpu_seconds(a.pid), cpu_seconds(b.pid))
                cpu[n].append([y - x for x, y in zip(c0, c1)])
    for n in names:
        v = t[n]
        print(f"{n:12s} median {statistics.median(v):.4f} s  {size/statistics.median(v)/MiB:7.0f} MiB/s",
              " ".join("%.3f" % x for x in v))
        print(f"{'':12s} cpu s: me {statistics.median(x[0] for x in cpu[n]):.3f}  A {statistics.median(x[1] for x in cpu[n]):.3f}  B {statistics.median(x[2] for x in cpu[n]):.3f}")
    d = statistics.median(t["daemon"]) if "daemon" in t else None
    for n in names:
        if d: print(f"{n} rate / daemon {d/statistics.median(t[n]):.3f}x")
finally:
    async def close():
        for c in clients: await c.close()
    loop.run_until_complete(close()); loop.close()
    a.stop(); b.stop()
    for p in extra: p.stop()
