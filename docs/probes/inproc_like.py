"""engine_inproc's run, with knobs: LAT (the 4 KiB phase, n writes per round), SEQ (paged+scatter before bulk), ROUNDS."""
import os, sys, statistics, time
sys.path.insert(0, os.getcwd())
import uvloop
from benchmarks import engine_inproc as ei
from benchmarks.engine_common import sides, start_pair, client_on, start_peers, GiB
from benchmarks.harness import Options, Pinning, daemon_command, interleave, quiet_gc
from benchmarks.scale_peers import start_all
def sched(pid):
    run = wait = sl = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            x = f.read().split(); run += int(x[0]); wait += int(x[1]); sl += int(x[2])
    return run / 1e9, wait / 1e9, sl
def cpu_seconds(pid): return sched(pid)
def cpus():
    out = []
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                x = [int(v) for v in line.split()[1:]]
                out.append((x[0] + x[1], x[2], x[5] + x[6], x[3] + x[4]))  # user sys irq+softirq idle
    return out
def peers_cpu(): return sum(sched(p.pid)[0] for p in peers)
E = os.environ.get
import gc
gcstat = {}
_gct = [0.0]
def _cb(phase, info):
    if phase == "start": _gct[0] = time.perf_counter()
    else:
        g = info["generation"]; c = gcstat.setdefault(g, [0, 0.0]); c[0] += 1; c[1] += time.perf_counter() - _gct[0]
gc.callbacks.append(_cb)
rounds = int(E("ROUNDS", "6")); n = int(E("LAT", "0")); seq = E("SEQ", "1") == "1"
pin = Pinning.detect(enabled=True); s = sides(Options(quick=False, pinning=pin, verbose=False))
loop = uvloop.new_event_loop()
a, b = start_pair(s)
peers = start_all([daemon_command() for _ in range(8)], s.target, [f"peer {i}" for i in range(8)])
pairs = {}
try:
    with client_on(s.initiator):
        arms, clients = loop.run_until_complete(ei._arms(a, b, peers, GiB))
    if E("BASE"):
        pairs, _ = start_peers(ei.PEER_KINDS, 1 << 20, s, lambda *x: None)
    with client_on(s.initiator):
        if n:
            for r, name in interleave(list(arms), rounds):
                with quiet_gc():
                    loop.run_until_complete(arms[name].lat(n))
        for arm in arms.values():
            for step in (arm.paged, arm.scatter, arm.bulk):
                loop.run_until_complete(step())
        bulk = {k: [] for k in arms}; cpu = {k: [] for k in arms}
        for r, name in interleave(list(arms), rounds):
            arm = arms[name]
            if seq:
                loop.run_until_complete(arm.paged()); loop.run_until_complete(arm.scatter())
            c0 = (cpu_seconds(os.getpid()), cpu_seconds(a.pid), cpu_seconds(b.pid))
            import subprocess, signal
            spid = os.getpid() if name == ei.INPROC else a.pid
            perf = subprocess.Popen(["perf", "stat", "-x,", "-e", "task-clock,context-switches,cpu-migrations,page-faults,cycles,instructions", "-p", f"{spid},{b.pid}", "--per-thread"] if E("PERF") else ["true"], stderr=subprocess.PIPE, text=True)
            time.sleep(0.3 if E("PERF") else 0)
            k0 = cpus(); p0 = peers_cpu()
            gcstat.clear()
            bulk[name].append(loop.run_until_complete(arm.bulk()))
            print('   gc during bulk', name[:8], {g: (c, round(x * 1e3, 1)) for g, (c, x) in gcstat.items()}, 'objects tracked', len(gc.get_objects()))
            k1 = cpus(); p1 = peers_cpu()
            if E("PERF"):
                perf.send_signal(signal.SIGINT); err = perf.communicate()[1]
                agg = {}
                for line in err.splitlines():
                    f = line.split(",")
                    if len(f) > 4:
                        who = "S" if f[0].rsplit("-", 1)[-1] and int(f[0].rsplit("-", 1)[-1]) in (spid,) or f[0].startswith(("python", "rpc-server")) and False else f[0]
                        agg.setdefault((f[0].rsplit("-",1)[0][:10], f[3]), 0.0)
                        try: agg[(f[0].rsplit("-",1)[0][:10], f[3])] += float(f[1])
                        except ValueError: pass
                print("   perf", name[:8], {k: round(v / (1e6 if k[1] == "task-clock" else 1), 1) for k, v in agg.items() if v})
            if E('V'): print('   cpu0 u/s/si/idle', [b_ - a_ for a_, b_ in zip(k0[0], k1[0])], 'cpu1', [b_ - a_ for a_, b_ in zip(k0[1], k1[1])], 'peers %.3f' % (p1 - p0))
            c1 = (cpu_seconds(os.getpid()), cpu_seconds(a.pid), cpu_seconds(b.pid))
            cpu[name].append([tuple(round(q - p, 3) for p, q in zip(x, y)) for x, y in zip(c0, c1)])
            if E('V'): print(name[:8], '%.3f' % bulk[name][-1], 'me', cpu[name][-1][0], 'A', cpu[name][-1][1], 'B', cpu[name][-1][2])
    for k, v in bulk.items():
        print(f"{k[:10]:10s} median {statistics.median(v):.4f}", " ".join("%.3f" % x for x in v),
              "")
    i, d = (statistics.median(bulk[k]) for k in (ei.INPROC, ei.DAEMON))
    print(f"inproc / daemon rate {d / i:.3f}x   (n={n} seq={seq} base={bool(E('BASE'))})")
finally:
    async def close():
        for c in clients: await c.close()
    loop.run_until_complete(close()); loop.close()
    for p in pairs.values(): p.stop()
    for p in (a, b, *peers): p.stop()
