import os, sys, time
ROOT = os.environ.get("TREE", "/work/main"); sys.path.insert(0, ROOT); os.chdir(ROOT)
from benchmarks.engine_common import client_on, GiB, sides, start_pair
from benchmarks.engine_verify import _Arm
from benchmarks.harness import Options
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")",1)[1].split()
    return int(f[11]) * 10, int(f[12]) * 10  # ms (HZ=100)
opts = Options() if not hasattr(Options, "quick") else Options()
s = sides(opts)
a, b = start_pair(s)
try:
    with client_on(s.initiator):
        arm = _Arm(a.url, b.url, GiB); arm.setup()
        for v in (False, True): arm.bulk(GiB, v)
        for rnd in range(3):
            for v in (False, True):
                ca, cb = cpu(a.proc.pid), cpu(b.proc.pid)
                dt = arm.bulk(GiB, v)
                ca2, cb2 = cpu(a.proc.pid), cpu(b.proc.pid)
                print(f"verify={v!s:5} {dt*1000:6.0f} ms  A user {ca2[0]-ca[0]:4d} sys {ca2[1]-ca[1]:4d}  B user {cb2[0]-cb[0]:4d} sys {cb2[1]-cb[1]:4d}")
        arm.close()
finally:
    b.stop(); a.stop()
