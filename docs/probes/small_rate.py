import os, sys, time, subprocess, asyncio
ROOT = os.environ.get("TREE", "/work/main"); sys.path.insert(0, ROOT); os.chdir(ROOT)
from benchmarks.harness import ServerProcess, daemon_command, Pinning
from benchmarks.engine_common import client_on, MiB
from benchmarks.engine_small import _Arm as Arm
base = daemon_command(); flags = base[3:] if base[1:2] == ["-m"] else base[1:]
argv = [sys.executable, "-m", "benchmarks.engine_steps", "daemon", *flags]
allowed = frozenset(os.sched_getaffinity(0))
pa = Pinning(frozenset({0}), frozenset({0}), allowed); pb = Pinning(frozenset({1}), frozenset({1}), allowed)
a = ServerProcess(argv, pa, name="A").start(); b = ServerProcess(argv, pb, name="B").start()
try:
    arm = Arm(a.url, b.url, 1 * MiB)
    with client_on(pa):
        arm.setup()
        arm.loop.run_until_complete(arm._rate(0.5))
        st = None
        if os.environ.get("STRACE"):
            st = subprocess.Popen(["strace", "-c", "-f", "-o", "/tmp/td-probe-strace-rate.txt", "-p", str(a.proc.pid)], stderr=subprocess.DEVNULL); time.sleep(1)
        r = arm.loop.run_until_complete(arm._rate(3.0))
        if st: st.send_signal(2); st.wait()
        print(f"rate {r:,.0f}/s")
        arm.close()
finally:
    b.stop(); a.stop()
