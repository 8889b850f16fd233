"""Does the idle NIXL pair (busy-polling) slow the transferd arms? 4 KiB p50 and 1 GiB, NIXL running vs SIGSTOPped, alternating."""
import asyncio, os, signal, statistics, sys, time
sys.path.insert(0, os.getcwd())
import uvloop
from benchmarks import engine_inproc as ei
from benchmarks.engine_common import sides, start_pair, client_on, start_peers, GiB
from benchmarks.harness import Options, Pinning, percentile, daemon_command
from benchmarks.scale_peers import start_all
s = sides(Options(quick=False, pinning=Pinning.detect(enabled=True), verbose=False))
loop = uvloop.new_event_loop()
a, b = start_pair(s)
peers = start_all([daemon_command()], s.target, ['peer 0'])
pairs, _ = start_peers(["nixl"], 1 << 20, s, lambda *x: None)
nixl = pairs["nixl"]
pids = [nixl.initiator.pid, nixl.target.pid]
def nixl_state(run):
    for p in pids: os.kill(p, signal.SIGCONT if run else signal.SIGSTOP)
    time.sleep(0.2)
try:
    with client_on(s.initiator):
        arms, clients = loop.run_until_complete(ei._arms(a, b, peers, GiB))
        for arm in arms.values():
            loop.run_until_complete(arm.lat(300)); loop.run_until_complete(arm.bulk())
        res = {}
        for r in range(int(os.environ.get("ROUNDS", "4"))):
            for run in ((True, False) if r % 2 == 0 else (False, True)):
                nixl_state(run)
                for name, arm in arms.items():
                    xs = loop.run_until_complete(arm.lat(int(os.environ.get("LAT", "2000")))) or [0.0]
                    bt = loop.run_until_complete(arm.bulk())
                    res.setdefault((name[:8], run), []).append((percentile(xs, 50), percentile(xs, 99), bt))
        nixl_state(True)
    for k, v in res.items():
        print(k, "nixl spinning" if k[1] else "nixl stopped ", "p50 %.1f us  p99 %.1f us  1 GiB %.3f s" % (
            statistics.median(x[0] for x in v) * 1e6, statistics.median(x[1] for x in v) * 1e6, statistics.median(x[2] for x in v)))
finally:
    async def close():
        for c in clients: await c.close()
    loop.run_until_complete(close()); loop.close()
    nixl.stop(); a.stop(); b.stop(); peers[0].stop()
