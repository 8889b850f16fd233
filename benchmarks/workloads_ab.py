"""A workload before and after an engine setting, in one run: ``python -m benchmarks.workloads_ab``.

Each placement (daemons, inproc) runs twice in the same rounds, once with the engine's
defaults and once with ``--set engine.KEY=VALUE`` (repeatable), every arm beside the same
floor, so that each "after" is read against the "before" taken at the same moment of a
shared machine::

    python -m benchmarks.workloads_ab kv --set watcher_idle_poll_ms=0.05 [--quick]
        [--daemons-only] [--json OUT]

It prints the workload's own tables and checks (the "after" arms named ``... +settings``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .harness import Options, Pinning
from .workloads_common import Daemons, Inproc, Placement

MODULES = {"kv": "workloads_kv", "moe": "workloads_moe"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("workload", choices=sorted(MODULES))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting of the 'after' arms (engine.KEY)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--daemons-only", action="store_true")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    if bad := [s for s in a.set if "=" not in s]:
        ap.error(f"--set takes KEY=VALUE, not {bad[0]!r}")
    settings = dict(s.removeprefix("engine.").split("=", 1) for s in a.set)
    tag = " +" + ",".join(f"{k}={v}" for k, v in settings.items())
    wheres: list[Placement] = [Daemons(), Daemons(engine=settings, name="transferd" + tag)]
    if not a.daemons_only:
        wheres += [Inproc(), Inproc(engine=settings, name="transferd inproc" + tag)]
    mod = __import__(f"benchmarks.{MODULES[a.workload]}", fromlist=["run"])
    opts = Options(quick=a.quick, pinning=Pinning.detect(), verbose=True)
    t0 = time.monotonic()
    res = mod.run(opts, wheres=wheres)
    res.seconds = time.monotonic() - t0
    print(res.render())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": sys.argv, "results": [res.to_json()]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
