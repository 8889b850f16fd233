import os, sys, time, pstats
ROOT = os.environ.get("TREE", "/work/main"); sys.path.insert(0, ROOT)
os.chdir(ROOT)
from benchmarks.harness import ServerProcess, daemon_command, Options
from benchmarks.engine_common import sides, client_on, MiB
from benchmarks.engine_steps import _Arm
import benchmarks.harness as h
N = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
base = daemon_command()
flags = base[3:] if base[1:2] == ["-m"] else base[1:]
argv = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "small_profile_daemon.py"), *flags]
from benchmarks.harness import Pinning
allowed = frozenset(os.sched_getaffinity(0))
pa = Pinning(frozenset({0}), frozenset({0}), allowed); pb = Pinning(frozenset({1}), frozenset({1}), allowed)
a = ServerProcess(argv, pa, name="A", env={"BENCH_PROFILE2": "/tmp/td-probe-a.pstats"}).start()
b = ServerProcess(argv, pb, name="B", env={"BENCH_PROFILE2": "/tmp/td-probe-b.pstats"}).start()
try:
    arm = _Arm(a.url, b.url, 1 * MiB)
    with client_on(pa):
        arm.setup()
        arm.timed(200)
        t = time.perf_counter(); w = arm.timed(N); dt = time.perf_counter() - t
        lat = sorted((e - s) / 1000 for s, e in w)
        print(f"{N} writes {dt:.2f}s p50 {lat[len(lat)//2]:.1f} us")
        arm.close()
finally:
    b.stop(); a.stop()
for f in ("a", "b"):
    print("=====", f)
    st = pstats.Stats(f"/tmp/td-probe-{f}.pstats"); st.sort_stats("tottime").print_stats(35)
