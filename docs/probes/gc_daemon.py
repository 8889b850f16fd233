# rpc-server with the cyclic collector set by GCMODE before anything is imported:
# "off" (gc.disable()), a number (the first generation's threshold), or unset (as shipped).
# Used as DAEMON=docs/probes/gc_daemon.py by small_cpu.py (issue 17, wave 7).
import gc, os, sys
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
mode = os.environ.get("GCMODE", "")
if mode == "off":
    gc.disable()
elif mode:
    gc.set_threshold(int(mode), 10, 10)
from rpc_server.cli import main
sys.argv = ["rpc-server", *sys.argv[1:]]
main()
