import os, sys, time, subprocess
ROOT = os.environ.get("TREE", "/work/main"); sys.path.insert(0, ROOT); os.chdir(ROOT)
from benchmarks.harness import ServerProcess, daemon_command, Pinning
from benchmarks.engine_common import client_on, MiB
from benchmarks.engine_steps import _Arm
N = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
PERF = len(sys.argv) > 2
base = daemon_command()
flags = base[3:] if base[1:2] == ["-m"] else base[1:]
# DAEMON=path: another entry for both daemons (gc_daemon.py: the collector's settings)
argv = ([sys.executable, os.environ["DAEMON"], *flags] if os.environ.get("DAEMON")
        else [sys.executable, "-m", "benchmarks.engine_steps", "daemon", *flags])
allowed = frozenset(os.sched_getaffinity(0))
pa = Pinning(frozenset({0}), frozenset({0}), allowed); pb = Pinning(frozenset({1}), frozenset({1}), allowed)
a = ServerProcess(argv, pa, name="A").start()
b = ServerProcess(argv, pb, name="B").start()
def threads(pid):
    return {t: (open(f"/proc/{pid}/task/{t}/comm").read().strip(), int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0])) for t in os.listdir(f"/proc/{pid}/task")}
def cpu(pid):
    tot = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        tot += int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0])
    return tot
def ut(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")",1)[1].split()
    return int(f[11]), int(f[12])
try:
    arm = _Arm(a.url, b.url, 1 * MiB)
    with client_on(pa):
        arm.setup(); arm.timed(500)
        pid_a, pid_b = a.proc.pid, b.proc.pid
        perf = None
        if PERF:
            perf = subprocess.Popen(["strace", "-c", "-f", "-o", "/tmp/td-probe-strace.txt", "-p", str(pid_a)], stderr=subprocess.DEVNULL) if os.environ.get("STRACE") else subprocess.Popen(["perf", "record", "-F", "4999", "-g", "-o", "/tmp/td-probe-perf.data", "-p", str(pid_a)], stderr=subprocess.DEVNULL)
            time.sleep(1)
        ta = threads(pid_a); ca, cb, ua = cpu(pid_a), cpu(pid_b), ut(pid_a)
        t = time.perf_counter(); pc = time.process_time(); w = arm.timed(N); dt = time.perf_counter() - t; pc = time.process_time() - pc
        ta2 = threads(pid_a); ca2, cb2, ua2 = cpu(pid_a), cpu(pid_b), ut(pid_a)
        if perf: perf.send_signal(2); perf.wait()
        lat = sorted((e - s) / 1000 for s, e in w)
        print(f"{N} writes {dt:.2f}s p50 {lat[len(lat)//2]:.1f} us; A cpu/write {(ca2-ca)/N/1000:.1f} us (user {(ua2[0]-ua[0])*10000/N:.1f} sys {(ua2[1]-ua[1])*10000/N:.1f}); B {(cb2-cb)/N/1000:.1f} us; client {pc/N*1e6:.1f} us")
        print({t: (ta2[t][0], (ta2[t][1]-ta.get(t,('',0))[1])/N/1000) for t in ta2})
        arm.close()
finally:
    b.stop(); a.stop()
