"""cProfile (CPU clock; PROF=0: none, CPU per step only) of one inproc MoE rank: 4 ranks (each its own process, its engine
inproc, tcp between them), STEPS steps in a row, rank 0 profiled; prints calls per step.

    TREE=/work/wt/yours $TREE/.venv/bin/python docs/probes/moe_profile.py [steps] [out]
"""
import asyncio
import cProfile
import multiprocessing as mp
import os
import pstats
import sys
import time

TREE = os.environ.get("TREE", os.getcwd())
sys.path.insert(0, TREE)
os.environ.setdefault("TRANSFERD_ENGINE_HOST_RAILS", "127.0.0.1")
RANKS, STEPS = 4, int(sys.argv[1]) if len(sys.argv) > 1 else 200
OUT = sys.argv[2] if len(sys.argv) > 2 else "/tmp/moe-rank0.pstats"
PROF = os.environ.get("PROF", "1") != "0"


def rank(i: int, infos, bar) -> None:
    from client import Client
    from examples.moe_dispatch import MoeRank, MoeShape, RankInfo, routing

    async def main() -> None:
        shape = MoeShape(ranks=RANKS, tokens=32)
        r = MoeRank(await Client.connect("inproc://"), shape, i)
        infos[i] = (await r.setup()).to_wire()
        bar.wait()
        await r.join([RankInfo.from_wire(infos[k]) for k in range(RANKS)])
        bar.wait()
        plan = routing(shape, STEPS + 20)
        await r.steps(plan[:20])  # warm
        bar.wait()
        prof = cProfile.Profile(time.process_time) if i == 0 and PROF else None
        c0, t0, o0 = time.process_time(), time.monotonic(), os.times()
        if prof:
            prof.enable()
        await r.steps(plan[20:])
        if prof:
            prof.disable()
        c1, t1, o1 = time.process_time(), time.monotonic(), os.times()
        print(f"rank {i}: {1e3 * (c1 - c0) / STEPS:.2f} ms CPU/step (user "
              f"{1e3 * (o1.user - o0.user) / STEPS:.2f}, sys {1e3 * (o1.system - o0.system) / STEPS:.2f}), "
              f"{1e3 * (t1 - t0) / STEPS:.2f} ms wall/step", flush=True)
        bar.wait()
        if prof:
            prof.dump_stats(OUT)
        await r.client.close()

    asyncio.run(main())


if __name__ == "__main__":
    ctx = mp.get_context("fork")
    mgr = ctx.Manager()
    infos, bar = mgr.dict(), ctx.Barrier(RANKS)
    ps = [ctx.Process(target=rank, args=(i, infos, bar)) for i in range(RANKS)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(600)
    if not PROF:
        sys.exit(0)
    st = pstats.Stats(OUT)
    print(f"calls per step (rank 0): {st.total_calls / STEPS:.0f}")
    st.sort_stats("tottime").print_stats(35)
