"""(5) Copies: payload bytes copied in user space per byte moved, for every data path.

Counted, not estimated, two independent ways, in the same run:

- ``counted``: :mod:`transferd.copies`.  Daemons A and B and a client process are
  started with ``TRANSFERD_COUNT_COPIES=1``; every place in the client, the
  session, the decoder, the transports, the engine and the memory layer that
  copies payload bytes in Python adds to a per-site count.  The daemons report
  theirs in STATS (``copies``), the client reads its own.
- ``memcpy``: ``benchmarks/memcount.c``, built here with the system's C compiler
  and preloaded (``LD_PRELOAD``) into the same three processes, counts every
  ``memcpy``/``memmove``/``mempcpy`` call of at least 256 bytes, whoever makes it
  (CPython, numpy, msgpack, uvloop).  A copy site the instrumentation missed shows
  as memcpy bytes above the counted ones.  Without a compiler this column says so.

Neither sees the kernel's copies (``recv_into``, ``sendmsg``: one each way per
socket hop, the same for any TCP design); both see every user-space one.

Paths (:mod:`benchmarks.copies_client`): set_tensor, get_tensor, get_tensor with
``out=``, a queued set and a batch of 8 queued gets (each with a flush), a single
write A -> B, a paged write A -> B, and a shared buffer (set and get in the
client's own mapping over unix://, and a single write from A into it), at 4 KiB
and 4 MiB.  Reported: bytes copied per byte moved, per process.

Also measured: what a site costs while counting is off (the ``if COUNTING:`` test
of a module constant, timed with ``timeit``), and a 4 KiB get_tensor's round trip in
alternating rounds against three daemons (each with its own client): one whose code has
no counts at all (a copy of the packages with every guarded count taken out, which,
asked to count, reports nothing: the proof it runs that code), one with counting off
(the default) and one with it on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .harness import (
    REPO,
    BenchResult,
    Check,
    Options,
    Pinning,
    ServerProcess,
    Table,
    clean_env,
    daemon_command,
    fmt_us,
    median,
)

NAME = "copies"
TITLE = "(5) payload bytes copied in user space per byte moved, every path, counted two ways"
SECTION = "How cost grows (issue 12)"

SOURCE = REPO / "benchmarks" / "memcount.c"
PROCS = ("client", "daemon A", "daemon B")
MEMCOUNT_MIN = 256


def build_memcount(where: str) -> tuple[str | None, str]:
    """The preload library, built into ``where``; (path, "") or (None, why not)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc) on this machine"
    out = os.path.join(where, "memcount.so")
    proc = subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", "-fno-builtin", "-fno-tree-loop-distribute-patterns",
         "-o", out, str(SOURCE), "-ldl"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return None, f"cc failed: {proc.stderr.strip()[-300:]}"
    return out, ""


def counting_env(lib: str | None, file: str) -> dict[str, str]:
    env = {"TRANSFERD_COUNT_COPIES": "1"}
    if lib is not None:
        env.update({"LD_PRELOAD": lib, "MEMCOUNT_FILE": file, "MEMCOUNT_MIN": str(MEMCOUNT_MIN)})
    return env


def guard_cost() -> dict[str, float]:
    """Seconds per ``if COUNTING:`` with counting off, and per loop turn without it."""
    g = {"COUNTING": False, "count": None}
    n = 2_000_000
    with_guard = min(timeit.repeat("if COUNTING: count('x', 1)", globals=g, number=n, repeat=5))
    empty = min(timeit.repeat("pass", globals=g, number=n, repeat=5))
    return {"guard_s": max(0.0, (with_guard - empty) / n), "loop_s": empty / n}


# A guarded count, as every site writes it (two lines).
GUARD = re.compile(r"^(?P<i>[ \t]*)if COUNTING(?: and [^:\n]+)?:\n(?P=i)    count\([^\n]*\)\n",
                   re.M)


def strip_counting(dst: str) -> int:
    """transferd, rpc_server and client copied into ``dst`` with every guarded count
    taken out (the code as it was before the counts); returns how many were."""
    removed = 0
    for pkg in ("transferd", "rpc_server", "client"):
        shutil.copytree(REPO / pkg, os.path.join(dst, pkg),
                        ignore=shutil.ignore_patterns("__pycache__"))
    for path in sorted(Path(dst).rglob("*.py")):
        text = path.read_text()
        new, n = GUARD.subn("", text)
        if n:
            compile(new, str(path), "exec")  # still Python
            path.write_text(new)
            removed += n
    return removed


def _tree_prelude(tree: str | None) -> str:
    return f"import sys; sys.path.insert(0, {tree!r})\n" if tree else ""


def stripped_daemon(tree: str) -> list[str]:
    """The daemon of a :func:`strip_counting` tree (its packages first on sys.path)."""
    code = (f"import runpy, sys; sys.path.insert(0, {tree!r}); "
            "runpy.run_module('rpc_server.cli', run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", code, "-H", "127.0.0.1", "-p", "0", "--metrics-port", "-1"]


def _get_p50(opts: Options, url: str, n: int, tree: str | None = None) -> float:
    code = (
        _tree_prelude(tree) +
        "import time, uvloop\n"
        "import client.connection\n"
        f"assert {tree!r} is None or client.connection.__file__.startswith({tree!r})\n"
        "from client import Client\n"
        "async def m():\n"
        f"    c = await Client.connect({url!r})\n"
        "    b = await c.alloc_buffer(4096); t = b.tensor(0, 4096)\n"
        "    xs = []\n"
        f"    for i in range({n} + 200):\n"
        "        t0 = time.perf_counter(); await c.get_tensor(t)\n"
        "        xs.append(time.perf_counter() - t0)\n"
        "    await c.close(); xs = sorted(xs[200:]); print(xs[len(xs) // 2])\n"
        "uvloop.run(m())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env=clean_env(),
                         preexec_fn=client_preexec(opts.pinning))
    if out.returncode != 0:
        raise RuntimeError(f"get_tensor probe failed: {out.stderr[-400:]}")
    return float(out.stdout.split()[-1])


def on_off_cost(opts: Options, where: str) -> dict[str, Any]:
    """4 KiB get_tensor p50, alternating: daemon and client with no counts in the code at
    all (``none``), with them and counting off (``off``, the default), counting on."""
    rounds, n = opts.pick(7, 2), opts.pick(1500, 300)
    tree = os.path.join(where, "uncounted")
    removed = strip_counting(tree)
    on_env = {"TRANSFERD_COUNT_COPIES": "1"}
    with (ServerProcess(daemon_command(), opts.pinning, name="rpc-server (off)") as off,
          ServerProcess(daemon_command(), opts.pinning, name="rpc-server (counting)",
                        env=on_env) as on,
          # Asked to count, it counts nothing: the proof that its code has no counts.
          ServerProcess(stripped_daemon(tree), opts.pinning, name="rpc-server (no counts)",
                        env=on_env) as none):
        arms = {"none": (none, tree), "off": (off, None), "on": (on, None)}
        per: dict[str, list[float]] = {k: [] for k in arms}
        for r in range(rounds):
            for name in list(arms) if r % 2 == 0 else list(reversed(arms)):
                d, t = arms[name]
                per[name].append(_get_p50(opts, d.url, n, t))
        uncounted = _copies_of(none.url, tree)
    if uncounted:
        raise AssertionError(f"the daemon without counts counted: {uncounted}")
    ratio = median([b / a for a, b in zip(per["off"], per["on"], strict=True)])
    off_vs_none = median([b / a for a, b in zip(per["none"], per["off"], strict=True)])
    return {"rounds": rounds, "n": n, "p50": per, "on_vs_off": ratio,
            "off_vs_none": off_vs_none, "sites_removed": removed}


def _copies_of(url: str, tree: str) -> dict[str, Any]:
    """STATS ``copies`` of a daemon, asked by a client of the uncounted tree."""
    code = (_tree_prelude(tree) +
            "import json, uvloop\nfrom client import Client\n"
            "async def m():\n"
            f"    c = await Client.connect({url!r})\n"
            "    print(json.dumps((await c.server_stats()).get('copies')))\n"
            "    await c.close()\n"
            "uvloop.run(m())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=REPO, env=clean_env())
    if out.returncode != 0:
        raise RuntimeError(f"STATS probe failed: {out.stderr[-400:]}")
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def run_paths(opts: Options, lib: str | None, where: str,
              sizes: str | None = None) -> dict[str, Any]:
    """Daemons A and B counting, the client role run against them; its JSON."""
    files = {p: os.path.join(where, f"{p.replace(' ', '_')}.cnt") for p in PROCS}
    sock = os.path.join(where, "b.sock")
    with (ServerProcess(daemon_command(), opts.pinning, name="daemon A",
                        env=counting_env(lib, files["daemon A"])) as a,
          ServerProcess(daemon_command("--unix", sock, "--listen", f"seqpacket://{sock}.s"),
                        opts.pinning, name="daemon B",
                        env=counting_env(lib, files["daemon B"])) as b):
        b_unix = next(u for u in b.urls if u.startswith("unix://"))
        b_seq = next(u for u in b.urls if u.startswith("seqpacket://"))
        argv = [sys.executable, "-m", "benchmarks.copies_client", "--a", a.url, "--b", b.url,
                "--b-unix", b_unix, "--b-seqpacket", b_seq, "--sizes",
                sizes or ("4096,4194304" if opts.quick else "4096,65536,4194304")]
        if lib is not None:
            argv += ["--memcount-client", files["client"], "--memcount-a", files["daemon A"],
                     "--memcount-b", files["daemon B"]]
        if opts.quick:
            argv.append("--quick")
        env = clean_env(counting_env(lib, files["client"]))
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO,
                              env=env, preexec_fn=client_preexec(opts.pinning))
    if proc.returncode != 0:
        raise RuntimeError(f"copies client failed ({proc.returncode}): {proc.stderr[-800:]}"
                           f" {proc.stdout[-400:]}")
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc


def _per_byte(n: int | None, moved: int) -> str:
    return "-" if n is None else f"{n / moved:.2f}"


def client_preexec(pinning: Pinning) -> Callable[[], None] | None:
    """For ``Popen(preexec_fn=...)``: a client subprocess on the client's CPUs."""
    cpus = pinning.client
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def run(opts: Options) -> BenchResult:
    res = BenchResult(NAME, TITLE, SECTION)
    where = tempfile.mkdtemp(prefix="td-copies-", dir="/tmp")
    try:
        lib, why = build_memcount(where)
        doc = run_paths(opts, lib, where)
        oo = on_off_cost(opts, where)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    table = Table(
        "bytes copied in user space per byte moved (counted by transferd.copies | memcpy "
        f"calls >= {MEMCOUNT_MIN} B counted by the preloaded library)",
        ["path", "size", "client", "daemon A", "daemon B", "memcpy client", "memcpy A",
         "memcpy B", "sites"])
    rows: list[dict[str, Any]] = []
    worst_gap = 0.0
    for r in doc["results"]:
        moved = r["moved"]
        counted = {p: sum(v["bytes"] for v in r["counted"][p].values()) for p in PROCS}
        # Less what two back-to-back readings of the counts copy (the STATS replies).
        mem = {p: None if r["memcpy"][p] is None
               else max(0, r["memcpy"][p]["bytes"] - r["idle"]["memcpy"][p]["bytes"])
               for p in PROCS}
        sites = sorted({f"{s}" for p in PROCS for s in r["counted"][p]})
        for p in PROCS:
            if mem[p] is not None:
                worst_gap = max(worst_gap, abs(mem[p] - counted[p]) / moved)
        size = r["size"]
        label = f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        table.add(r["path"], label, *(_per_byte(counted[p], moved) for p in PROCS),
                  *(_per_byte(mem[p], moved) for p in PROCS),
                  ", ".join(sites) or "none")
        rows.append({"path": r["path"], "size": size, "reps": r["reps"], "moved": moved,
                     "counted_per_byte": {p: counted[p] / moved for p in PROCS},
                     "memcpy_per_byte": {p: None if mem[p] is None else mem[p] / moved
                                         for p in PROCS},
                     "sites": r["counted"], "memcpy": r["memcpy"]})
    res.tables.append(table)
    if lib is None:
        res.notes.append(f"memcpy cross-check not available: {why}")
    else:
        res.checks.append(Check("largest |memcpy - counted| per byte moved, any path/process",
                                worst_gap, "<=", 0.05))
    g = guard_cost()
    t = Table("what counting costs (4 KiB get_tensor p50, alternating rounds)",
              ["", "value"])
    t.add("one `if COUNTING:` with counting off", f"{g['guard_s'] * 1e9:.1f} ns")
    t.add(f"get_tensor p50, no counts in the code ({oo['sites_removed']} sites taken out)",
          f"{fmt_us(median(oo['p50']['none']))} us")
    t.add("get_tensor p50, counting off (the default)",
          f"{fmt_us(median(oo['p50']['off']))} us")
    t.add("get_tensor p50, counting on", f"{fmt_us(median(oo['p50']['on']))} us")
    t.add("off / no counts (median of per-round ratios)", f"{oo['off_vs_none']:.3f}x")
    t.add("on / off (median of per-round ratios)", f"{oo['on_vs_off']:.3f}x")
    res.tables.append(t)
    res.notes.append(
        f"off, a 4 KiB get_tensor passes 3 guards (client send, daemon decoder, daemon reply "
        f"join: {3 * g['guard_s'] * 1e9:.0f} ns), "
        f"{3 * g['guard_s'] / median(oo['p50']['off']) * 100:.3f}% of its round trip")
    res.notes.append(
        "per process: client = the process calling the API; daemon A = the daemon it talks "
        "to (and the initiator of writes); daemon B = the target of writes (and the owner of "
        "the shared buffer, over unix://); kernel copies (recv/send) are in neither count")
    res.data = {"rows": rows, "guard": g, "on_off": oo, "memcount": lib is not None,
                "memcount_min": MEMCOUNT_MIN}
    return res
