# CPU per 4 KiB get (daemon via schedstat, client via thread_time), optional cProfile counts.
import os, sys, time, asyncio, cProfile, pstats
ROOT = os.environ["TREE"]; sys.path.insert(0, ROOT); os.chdir(ROOT)
from benchmarks.harness import ServerProcess, daemon_command, Pinning
N = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
PROF = os.environ.get("PROF")
MODE = os.environ.get("MODE", "get")
base = daemon_command()
flags = base[3:] if base[1:2] == ["-m"] else base[1:]
argv = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "batch_daemon.py"), *flags]
allowed = frozenset(os.sched_getaffinity(0))
pa = Pinning(frozenset({0}), frozenset({1}), allowed)
env = {"TREE": ROOT}
if PROF: env["BENCH_PROFILE2"] = "/tmp/td-probe-d.pstats"
d = ServerProcess(argv, pa, name="d", env=env).start()
os.sched_setaffinity(0, {1})
def cpu(pid):
    return sum(int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0]) for t in os.listdir(f"/proc/{pid}/task"))
async def main():
    import uvloop
    from client import Client
    c = await Client.connect(d.url)
    buf = await c.alloc_buffer(4096 * 256)
    t = buf.tensor(4096, 4096)
    await c.set_tensor(t, b"x" * 4096)
    if MODE == "get":
        async def op():
            await c.get_tensor(t)
    else:
        K = int(os.environ.get("K", "32")); S = int(os.environ.get("S", "4"))
        ts = [buf.tensor(i * S, S) for i in range(K)]
        data = b"y" * S
        async def op():
            for x in ts: c.set_tensor_async(x, data)
            fs = [c.get_tensor_async(x) for x in ts]
            await c.flush()
            for f in fs: await f
    for _ in range(500): await op()
    p = cProfile.Profile(time.thread_time) if PROF else None
    import subprocess
    st = None
    if os.environ.get("STRACE"):
        st = subprocess.Popen(["strace", "-c", "-f", "-p", str(d.proc.pid), "-o", "/tmp/td-probe-strace-d.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        st2 = subprocess.Popen(["strace", "-c", "-p", str(os.getpid()), "-o", "/tmp/td-probe-strace-c.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await asyncio.sleep(0.5)
    c0 = cpu(d.proc.pid); t0 = time.thread_time(); w0 = time.perf_counter()
    if p: os.kill(d.proc.pid, 10); await asyncio.sleep(0.1); p.enable()
    for _ in range(N): await op()
    if p: p.disable(); os.kill(d.proc.pid, 12); await asyncio.sleep(0.3)
    if st:
        await asyncio.sleep(0.2); st.send_signal(2); st.wait(); st2.send_signal(2); st2.wait()
    w = time.perf_counter() - w0; ct = time.thread_time() - t0; dc = cpu(d.proc.pid) - c0
    print(f"{MODE}: {N} ops wall/op {w/N*1e6:.1f} us; daemon cpu/op {dc/N/1000:.1f} us; client cpu/op {ct/N*1e6:.1f} us")
    await c.close()
    return p
import uvloop
p = uvloop.run(main())
d.stop()
if p:
    p.dump_stats("/tmp/td-probe-c.pstats"); st = pstats.Stats(p)
    tot = sum(v[1] for v in st.stats.values())
    print("client calls/op", tot / N)
    st.sort_stats("tottime").print_stats(25)
    st = pstats.Stats("/tmp/td-probe-d.pstats")
    tot = sum(v[1] for v in st.stats.values())
    print("daemon calls/op", tot/N)
    st.sort_stats("tottime").print_stats(30)
