"""``make fuzz``: every target for a bounded time, each in its own process.

    python -m fuzzing.run [--seconds 240] [--only decoder,dispatch] [--fallback]

The seed corpus is written from docs/protocol.md first (fuzzing/corpus.py) into
``.fuzz/corpus/<target>/``; atheris (libFuzzer) adds the inputs it finds there, so later
runs start from them.  A failing input goes to ``.fuzz/artifacts/`` (``crash-``,
``timeout-``, ``oom-``); replay one with ``python -m fuzzing.fuzz_<target> FILE``.
The time is shared out: the dispatch target (a daemon in-process, real sockets) gets a
third of it, the five pure ones the rest.  Exit status 1 if any target failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from fuzzing.corpus import REPO, TARGETS, write
from fuzzing.driver import atheris_module

FUZZ_DIR = REPO / ".fuzz"


def shares(seconds: float, targets: list[str]) -> dict[str, int]:
    """Seconds per target: dispatch a third (when it runs), the others equal parts."""
    if "dispatch" in targets and len(targets) > 1:
        out = {"dispatch": max(5, int(seconds / 3))}
        rest = [t for t in targets if t != "dispatch"]
        out.update({t: max(5, int((seconds - out["dispatch"]) / len(rest))) for t in rest})
        return out
    return {t: max(5, int(seconds / len(targets))) for t in targets}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float,
                    default=float(os.environ.get("FUZZ_SECONDS", "240")),
                    help="all targets together (default $FUZZ_SECONDS or 240)")
    ap.add_argument("--only", default="", help="comma-separated targets (default: all)")
    ap.add_argument("--fallback", action="store_true",
                    help="use the fallback driver even where atheris is installed")
    args = ap.parse_args(argv)
    targets = [t for t in args.only.split(",") if t] or list(TARGETS)
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)}; have {', '.join(TARGETS)}")
    env = dict(os.environ)
    if args.fallback:
        env["FUZZ_DRIVER"] = "fallback"
    driver = "fallback" if args.fallback or atheris_module() is None else "atheris"
    corpus = FUZZ_DIR / "corpus"
    artifacts = FUZZ_DIR / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    seeds = write(corpus)
    print(f"fuzz: driver {driver}; seeds from docs/protocol.md: "
          + ", ".join(f"{t} {n}" for t, n in seeds.items()), flush=True)
    failed = []
    for target, secs in shares(args.seconds, targets).items():
        cmd = [sys.executable, "-m", f"fuzzing.fuzz_{target}", f"-max_total_time={secs}",
               "-timeout=20", "-rss_limit_mb=4096", f"-artifact_prefix={artifacts}/",
               str(corpus / target)]
        started = time.monotonic()
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=secs + 120)
        took = time.monotonic() - started
        tail = (r.stderr or "").strip().splitlines()
        done = next((ln for ln in reversed(tail) if ln.startswith(("Done ", "fallback driver"))),
                    "")
        status = "ok" if r.returncode == 0 else f"FAILED (exit {r.returncode})"
        print(f"fuzz: {target:18} {took:6.1f} s  {status}  {done}", flush=True)
        if r.returncode != 0:
            failed.append(target)
            print("\n".join(tail[-40:]), file=sys.stderr)
    if failed:
        print(f"fuzz: failed: {', '.join(failed)}; inputs in {artifacts}", file=sys.stderr)
        return 1
    print(f"fuzz: no failure in {len(targets)} target(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
