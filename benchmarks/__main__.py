"""``python -m benchmarks [--only NAME] [--quick] [--json OUT]``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from typing import Any

from . import BENCHMARKS, GROUPS
from .harness import BenchResult, Options, Pinning, machine_info


def _load(name: str) -> Any:
    return importlib.import_module(f"benchmarks.{name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run transferd's benchmarks, each side by side with its baseline.",
    )
    ap.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help=f"run only this benchmark (repeatable, or comma separated): {', '.join(BENCHMARKS)}"
        f"; or a group: {', '.join(GROUPS)}",
    )
    ap.add_argument("--quick", action="store_true", help="fewer rounds and samples (< 1 minute)")
    ap.add_argument("--json", metavar="OUT", help="write every number to this JSON file")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    ap.add_argument("--no-pin", action="store_true", help="do not pin servers and client to CPUs")
    ap.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    ap.add_argument(
        "--strict", action="store_true", help="exit 1 when a target is missed (default: 0)"
    )
    a = ap.parse_args(argv)

    if a.list:
        for name in BENCHMARKS:
            mod = _load(name)
            print(f"{name:12s} [{mod.SECTION}] {mod.TITLE}")
        return 0
    names = list(BENCHMARKS)
    if a.only:
        names = [n.strip() for arg in a.only for n in arg.split(",") if n.strip()]
        names = [m for n in names for m in GROUPS.get(n, [n])]
        unknown = [n for n in names if n not in BENCHMARKS]
        if unknown:
            ap.error(f"unknown benchmark(s) {', '.join(unknown)}; have {', '.join(BENCHMARKS)}")

    pinning = Pinning.detect(enabled=not a.no_pin)
    pinning.pin_client()
    opts = Options(quick=a.quick, pinning=pinning, verbose=a.verbose)
    info = machine_info(pinning)
    cmdline = "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"transferd benchmarks  {info['date']}  ({'quick' if a.quick else 'full'} run)")
    print(
        f"machine: {info['nproc']} CPUs ({info['cpu_model']}), kernel {info['kernel']}, "
        f"python {info['python']}, uvloop {info['uvloop']}, load {info['loadavg'][0]:.2f}"
    )
    print(f"pinning: {pinning.describe()}")
    print(f"command: {cmdline.strip()}")
    print(flush=True)

    results: list[BenchResult] = []
    failed: list[str] = []
    started = time.monotonic()
    for name in names:
        mod = _load(name)
        t0 = time.monotonic()
        try:
            res: BenchResult = mod.run(opts)
        except Exception:
            traceback.print_exc()
            failed.append(name)
            print(f"== {name}: FAILED ==\n", flush=True)
            continue
        res.seconds = time.monotonic() - t0
        results.append(res)
        print(res.render(), flush=True)
        print(flush=True)

    checks = [(r.name, c) for r in results for c in r.checks]
    print("== summary ==")
    for name, c in checks:
        print(f"[{name}] {c.line()}")
    for name in failed:
        print(f"[{name}] ERROR  the benchmark did not run to the end")
    missed = sum(not c.passed for _, c in checks)
    print(
        f"{len(checks) - missed}/{len(checks)} targets met"
        f"{f', {len(failed)} benchmark(s) failed' if failed else ''}"
        f" in {time.monotonic() - started:.0f} s"
    )
    if a.json:
        doc = {
            "command": cmdline.strip(),
            "loadavg_end": os.getloadavg(),
            "seconds": time.monotonic() - started,
            "quick": a.quick,
            "machine": info,
            "results": [r.to_json() for r in results],
            "failed": failed,
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2, default=str)
            f.write("\n")
        print(f"wrote {a.json}")
    if failed:
        return 2
    return 1 if (a.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
