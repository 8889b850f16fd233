import os, sys, atexit, time, cProfile
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
prof = os.environ.get("BENCH_PROFILE2")
if prof:
    p = cProfile.Profile(time.thread_time) if os.environ.get("PROF_CPU") else cProfile.Profile()
    p.enable()
    def d():
        p.disable(); p.dump_stats(prof)
    atexit.register(d)
from rpc_server.cli import main
sys.argv = ["rpc-server", *sys.argv[1:]]
main()
