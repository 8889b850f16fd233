import os, sys, time
ROOT = os.environ.get("TREE", "/work/main"); sys.path.insert(0, ROOT); os.chdir(ROOT)
from benchmarks.harness import ServerProcess, daemon_command, Pinning
from benchmarks.engine_common import client_on, MiB
from benchmarks.engine_steps import _Arm
N = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
base = daemon_command(); flags = base[3:] if base[1:2] == ["-m"] else base[1:]
argv = [sys.executable, "-m", "benchmarks.engine_steps", "daemon", *flags]
allowed = frozenset(os.sched_getaffinity(0))
pa = Pinning(frozenset({0}), frozenset({0}), allowed); pb = Pinning(frozenset({1}), frozenset({1}), allowed)
# The same daemon A serves both arms: its TCP port and a Unix socket (issue 17, wave 7).
for f in ("/tmp/tdA.sock",):
    if os.path.exists(f): os.unlink(f)
a = ServerProcess(argv + ["--unix", "/tmp/tdA.sock"], pa, name="A").start(); b = ServerProcess(argv, pb, name="B").start()
def cpu(pid):
    return sum(int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0]) for t in os.listdir(f"/proc/{pid}/task"))
try:
    arms = {"tcp": _Arm(a.url, b.url, MiB), "unix": _Arm("unix:///tmp/tdA.sock", b.url, MiB)}
    with client_on(pa):
        for arm in arms.values(): arm.setup(); arm.timed(300)
        res = {k: [] for k in arms}
        for r in range(4):
            for k, arm in arms.items():
                ca = cpu(a.proc.pid); pc = time.process_time()
                w = arm.timed(N)
                ca = (cpu(a.proc.pid) - ca) / N / 1000; pc = (time.process_time() - pc) / N * 1e6
                lat = sorted((e - s) / 1000 for s, e in w)
                res[k].append((lat[len(lat)//2], ca, pc))
        for k, v in res.items():
            print(k, " ".join(f"p50 {x:.0f} A {y:.0f} cl {z:.0f} |" for x, y, z in v))
        for arm in arms.values(): arm.close()
finally:
    b.stop(); a.stop()
