import os, sys, time
sys.path.insert(0, os.getcwd())
from benchmarks.engine_common import sides, start_peers
from benchmarks.harness import Options, Pinning
from benchmarks.scale_common import cpu_seconds
s = sides(Options(quick=False, pinning=Pinning.detect(enabled=True), verbose=False))
pairs, missing = start_peers(("socket", "mooncake", "nixl"), 1 << 20, s, print)
time.sleep(1)
for k, p in pairs.items():
    pids = [getattr(p, x).pid for x in dir(p) if hasattr(getattr(p, x), "pid")]
    print(k, [x for x in dir(p) if not x.startswith("__")][:12])
    break
import subprocess
out = subprocess.run(["ps", "-o", "pid,psr,comm,args", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
print(out)
pids = [int(l.split()[0]) for l in out.splitlines()[1:] if os.path.exists(f"/proc/{l.split()[0]}/task")]
c0 = {p: cpu_seconds(p) for p in pids}; time.sleep(2); c1 = {p: cpu_seconds(p) for p in pids}
for p in pids: print(p, "idle CPU share over 2 s: %.3f" % ((c1[p] - c0[p]) / 2))
for p in pairs.values(): p.stop()
