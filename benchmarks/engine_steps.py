"""(g) Where a 4 KiB engine write's time goes: timestamps of every step, in every process.

The same write as ``engine_latency`` (a client of daemon A writes 4 KiB into a
region of daemon B and awaits the completion), run ``n`` times back to back with
daemons started through this module (``python -m benchmarks.engine_steps daemon
ARGS``), which wraps a few functions of the daemon with a timestamp
(``time.monotonic_ns``: CLOCK_MONOTONIC, one clock for every process on the
machine) before it runs ``rpc_server.cli``:

- A ``read``: the session's ``buffer_updated`` (the SINGLE_WRITE frame is in);
- A ``submit``: ``TransferEngine.submit_single_write`` (the handler has parsed it);
- A ``execute``: ``DomainGroup.execute`` (on the worker: the hand-off is done);
- A ``sent``: the peer link's first ``flush`` after it (the WRITE is on the socket);
- B ``read``: B's peer link is readable (the WRITE arrived);
- B ``sent``: B's ``flush`` (the ACK is on the socket);
- A ``ack``: A's peer link is readable (the ACK arrived);
- A ``finished``: ``TransferEngine._finished`` (back on the daemon's loop);
- A ``event``: the session's ``send_frame`` returned (the EVENT is written);
- the client's ``done``: its ``await`` returned.

The writes are sequential, so every event between the client's submit of write
i and of write i + 1 belongs to write i.  The table gives the median of each
step's time since the client's submit, for the loop worker and the thread
worker, and the difference.  The wrappers cost about a microsecond each; the
figure of record is ``engine_latency``'s.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .engine_common import SECTION, MiB, Sides, TransferdArm, client_on, sides
from .harness import BenchResult, Options, ServerProcess, Table, daemon_command, median

NAME = "engine_steps"
TITLE = "(g) 4 KiB write: every step's timestamp, loop worker and thread worker"
SECTION = SECTION

SIZE = 4096
ENV_OUT = "BENCH_STEPS_OUT"
ENV_SET = "BENCH_SET"  # "pkg.module.NAME=int,...": constants set for an experiment
ENV_PROFILE = "BENCH_PROFILE"  # a path: cProfile the daemon, pstats written there at exit
# (process, tag) in path order; the report's rows.
STEPS = [("A", "read"), ("A", "submit"), ("A", "execute"), ("A", "sent"), ("B", "read"),
         ("B", "sent"), ("A", "ack"), ("A", "finished"), ("A", "event"), ("client", "done")]
LIMIT = 1 << 18  # events one daemon keeps (a bound: the run is a few thousand writes)


# -- inside a daemon ------------------------------------------------------------------------


def _install(out: str) -> None:
    """Wrap the daemon's functions with timestamps; dump them to ``out`` at exit."""
    from rpc_server.session import Session
    from transferd.domains.group import DomainGroup
    from transferd.domains.link_io import SocketLink
    from transferd.engine.engine import TransferEngine

    events: list[tuple[str, int]] = []
    clock = time.monotonic_ns

    def mark(tag: str) -> None:
        if len(events) < LIMIT:
            events.append((tag, clock()))

    def before(cls: Any, name: str, tag: str) -> None:
        fn = getattr(cls, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            mark(tag)
            return fn(*a, **k)

        setattr(cls, name, wrapped)

    def after(cls: Any, name: str, tag: str) -> None:
        fn = getattr(cls, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            r = fn(*a, **k)
            mark(tag)
            return r

        setattr(cls, name, wrapped)

    before(Session, "buffer_updated", "read")
    before(TransferEngine, "submit_single_write", "submit")
    before(DomainGroup, "execute", "execute")
    after(SocketLink, "flush", "sent")
    before(SocketLink, "_readable", "peer_read")
    before(TransferEngine, "_finished", "finished")
    after(Session, "send_frame", "event")

    def dump() -> None:
        with open(out, "w") as f:
            json.dump(events, f)

    atexit.register(dump)


def daemon_main(argv: list[str]) -> None:
    out = os.environ.get(ENV_OUT)
    if out:
        _install(out)
    for item in filter(None, os.environ.get(ENV_SET, "").split(",")):
        # An experiment: a module constant set before the daemon starts.
        import importlib

        where, _, value = item.partition("=")
        module, _, name = where.rpartition(".")
        setattr(importlib.import_module(module), name, int(value))
    prof = os.environ.get(ENV_PROFILE)
    if prof:
        # cProfile of the whole daemon (py-spy is not installed here), dumped at exit.
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        def dump_profile() -> None:
            profiler.disable()
            profiler.dump_stats(prof)

        atexit.register(dump_profile)
    from rpc_server.cli import main

    sys.argv = ["rpc-server", *argv]
    main()


# -- the measurement ------------------------------------------------------------------------


class _Arm(TransferdArm):
    async def _run(self, n: int) -> list[tuple[int, int]]:
        submit = self.ca.submit_single_write
        src, dst = (self.mr, 0), (self.desc, 0)
        clock = time.monotonic_ns
        out = []
        for _ in range(n):
            t0 = clock()
            await (await submit(SIZE, None, src, dst))
            out.append((t0, clock()))
        return out

    def timed(self, n: int) -> list[tuple[int, int]]:
        return list(self.loop.run_until_complete(self._run(n)))


@contextlib.contextmanager
def _pair(s: Sides, worker: str, where: Path) -> Iterator[tuple[ServerProcess, ServerProcess,
                                                                 Path, Path]]:
    outs = (where / f"{worker}-a.json", where / f"{worker}-b.json")
    base = daemon_command()
    # The daemon's own flags, run through this module instead of the rpc-server script.
    flags = base[3:] if base[1:2] == ["-m"] else base[1:]
    argv = [sys.executable, "-m", "benchmarks.engine_steps", "daemon", *flags]
    a = ServerProcess(argv, s.initiator, name=f"daemon A ({worker})",
                      env={"TRANSFERD_ENGINE_WORKER": worker, ENV_OUT: str(outs[0])}).start()
    try:
        b = ServerProcess(argv, s.target, name=f"daemon B ({worker})",
                          env={"TRANSFERD_ENGINE_WORKER": worker, ENV_OUT: str(outs[1])}
                          ).start()
    except BaseException:
        a.stop()
        raise
    try:
        yield a, b, outs[0], outs[1]
    finally:
        b.stop()
        a.stop()


def _steps(writes: list[tuple[int, int]], a: list[tuple[str, int]], b: list[tuple[str, int]]
           ) -> dict[str, list[float]]:
    """Each step's time since the client's submit (us), per write, matched by window."""
    tags_a = {"read": "read", "submit": "submit", "execute": "execute", "sent": "sent",
              "peer_read": "ack", "finished": "finished", "event": "event"}
    out: dict[str, list[float]] = {f"{p} {t}": [] for p, t in STEPS}
    ia = ib = 0
    for k, (t0, t1) in enumerate(writes):
        end = writes[k + 1][0] if k + 1 < len(writes) else t1 + 1
        seen: dict[str, int] = {}
        while ia < len(a) and a[ia][1] < t0:
            ia += 1
        j = ia
        while j < len(a) and a[j][1] < end:
            tag = tags_a.get(a[j][0])
            # A's first "sent" after execute is the WRITE; its first peer_read the ACK.
            if tag is not None and tag not in seen and (tag != "event" or "finished" in seen):
                seen[tag] = a[j][1]
            j += 1
        while ib < len(b) and b[ib][1] < t0:
            ib += 1
        j = ib
        while j < len(b) and b[j][1] < end:
            tag = {"peer_read": "read", "sent": "sent"}.get(b[j][0])
            if tag is not None and f"B {tag}" not in seen:
                seen[f"B {tag}"] = b[j][1]
            j += 1
        row = {f"A {t}": v for t, v in seen.items() if not t.startswith("B ")}
        row.update({t: v for t, v in seen.items() if t.startswith("B ")})
        row["client done"] = t1
        if len(row) != len(STEPS):
            continue  # a write whose steps did not all show (the first, or a dump cut)
        for name, v in row.items():
            out[name].append((v - t0) / 1000.0)
    return out


def run(opts: Options) -> BenchResult:
    res = BenchResult(NAME, TITLE, SECTION)
    s = sides(opts)
    n = opts.pick(1000, 300)
    warm = opts.pick(200, 50)
    per: dict[str, dict[str, float]] = {}
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="td-steps-") as tmp:
        for worker in ("loop", "thread"):
            with _pair(s, worker, Path(tmp)) as (a, b, out_a, out_b):
                arm = _Arm(a.url, b.url, 1 * MiB)
                with client_on(s.initiator):
                    arm.setup()
                    try:
                        arm.timed(warm)
                        writes = arm.timed(n)
                    finally:
                        arm.close()
            # The daemons dumped their events at exit.
            ev_a = [(str(t), int(v)) for t, v in json.loads(out_a.read_text())]
            ev_b = [(str(t), int(v)) for t, v in json.loads(out_b.read_text())]
            steps = _steps(writes, ev_a, ev_b)
            counts[worker] = len(steps["client done"])
            per[worker] = {k: median(v) for k, v in steps.items() if v}
            opts.log(f"{worker}: {counts[worker]} writes matched")
    table = Table(f"4 KiB write, {n} back to back per worker kind: median us since the "
                  "client's submit (CLOCK_MONOTONIC in every process)",
                  ["step", "loop worker", "thread worker", "thread - loop"])
    for p, t in STEPS:
        k = f"{p} {t}"
        lo, th = per["loop"].get(k, float("nan")), per["thread"].get(k, float("nan"))
        table.add(k, f"{lo:,.1f}", f"{th:,.1f}", f"{th - lo:+,.1f}")
    res.tables.append(table)
    res.notes.append(f"placement: {s.describe()}")
    res.notes.append(f"writes matched (every step seen): {counts}")
    res.data = {"n": n, "medians_us": per, "matched": counts, "placement": s.describe()}
    return res


def _main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "daemon":
        daemon_main(sys.argv[2:])
        return
    print("usage: python -m benchmarks.engine_steps daemon RPC-SERVER-ARGS "
          "(or python -m benchmarks --only engine_steps)", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    _main()
