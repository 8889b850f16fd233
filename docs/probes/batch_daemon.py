import os, sys, atexit, time, cProfile, signal
sys.path.insert(0, os.environ["TREE"])
prof = os.environ.get("BENCH_PROFILE2")
if prof:
    p = cProfile.Profile(time.thread_time)
    def on(*a): p.enable()
    def off(*a):
        p.disable(); p.dump_stats(prof)
    signal.signal(signal.SIGUSR1, on); signal.signal(signal.SIGUSR2, off)
from rpc_server.cli import main
sys.argv = ["rpc-server", *sys.argv[1:]]
main()
