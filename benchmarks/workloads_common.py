"""What the workload figures share: where each node runs, its role in a process of its own.

The three workloads (``workloads_kv``, ``workloads_rl``, ``workloads_moe``) are systems,
not operations: a prefill node and a decode node, a trainer and its inference nodes, MoE
ranks.  Each node of a system is a **role** (a class of the workload's module, in
``ROLES``) run in a process of its own (:class:`RoleProcess`, ``python -m
benchmarks.workloads_common role MODULE ROLE ARGS``), pinned beside its engine, and driven
by JSON lines from the benchmark: one answer per command, ``{"error": ...}`` when one
fails.  Roles timestamp their steps with ``time.monotonic_ns`` (CLOCK_MONOTONIC, one clock
for every process of the machine), so a time can start in one process and end in another.

**Placement** (:class:`Placement`) is which engine each node's role talks to.
:class:`Daemons`: one daemon per node (``rpc-server`` over tcp, ``rails`` loopback rails
each), started here and pinned on the node's CPU.  An in-process engine (issue 21) is
another Placement whose URLs are ``inproc://...`` and that starts nothing: the roles are
written against the public client API only, so they run on it unchanged.

**Floors**: the same bytes and messages moved by plain sockets between processes placed
the same way (:mod:`benchmarks.workloads_floor`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from .engine_common import PeerProcess, PeerUnavailable
from .harness import Options, Pinning, ServerProcess, daemon_command, percentile

SECTION = "Workloads (issue 25)"
MiB = 1 << 20
GiB = 1 << 30


# -- where nodes run ----------------------------------------------------------------------


def cpu_of(opts: Options, i: int) -> Pinning:
    """Node ``i``'s CPU: the allowed CPUs in turn (everything unpinned under --no-pin)."""
    allowed = opts.pinning.allowed
    if opts.pinning.server is None:
        return Pinning(None, None, allowed)
    cpus = sorted(allowed)
    one = frozenset({cpus[i % len(cpus)]})
    return Pinning(one, one, allowed)


def describe_cpus(pins: Sequence[Pinning], names: Sequence[str]) -> str:
    if any(p.server is None for p in pins):
        return "not pinned (--no-pin)"
    return ", ".join(f"{n} on CPU {','.join(map(str, sorted(p.server or ())))}"
                     for n, p in zip(names, pins, strict=True))


@dataclass(frozen=True)
class Engine:
    """A node's engine: the URL its role connects to, and the process it runs in when
    that is not the role's own (a daemon's pid; None in process)."""

    url: str
    pid: int | None = None


class Placement(Protocol):
    """Which engine each node's role talks to; ``engines`` yields one per node.

    ``arm``: the benchmark arm's name on this placement; ``role_env``: what a role's
    process needs in its environment to reach (or to be) its engine."""

    @property
    def label(self) -> str: ...

    @property
    def arm(self) -> str: ...

    @property
    def role_env(self) -> dict[str, str]: ...

    def engines(self, pins: Sequence[Pinning]
                ) -> contextlib.AbstractContextManager[list[Engine]]:
        ...


def rail_hosts(rails: int) -> list[str]:
    # Every address of 127.0.0.0/8 is loopback; daemons share them on ports of their own.
    return [f"127.0.0.{i + 1}" for i in range(rails)]


def engine_env(settings: dict[str, str]) -> dict[str, str]:
    """``engine.KEY`` settings as the variables an engine reads them from (daemon or
    inproc alike): ``{"watcher_idle_poll_ms": "0.05"}`` -> TRANSFERD_ENGINE_WATCHER_..."""
    return {f"TRANSFERD_ENGINE_{k.upper()}": v for k, v in settings.items()}


@dataclass
class Daemons:
    """One daemon per node, over tcp, with ``rails`` rails each, pinned on the node's CPU.

    ``steps_dir``: run each daemon through :mod:`benchmarks.engine_steps` instead, which
    timestamps its steps and writes them to ``steps_dir/daemon-I.json`` when it stops.
    ``engine``: engine settings of every node (``engine_env``); ``name``: the arm's name
    when not the default (two arms of one placement with other settings, in one run)."""

    rails: int = 1
    steps_dir: Path | None = None
    engine: dict[str, str] = field(default_factory=dict)
    name: str = ""

    @property
    def label(self) -> str:
        return f"daemons over tcp, {_rails(self.rails)} each{_settings(self.engine)}"

    @property
    def arm(self) -> str:
        return self.name or "transferd"

    @property
    def role_env(self) -> dict[str, str]:
        return {}

    def _argv(self) -> list[str]:
        base = daemon_command()
        if self.steps_dir is None:
            return base
        flags = base[3:] if base[1:2] == ["-m"] else base[1:]
        return [sys.executable, "-m", "benchmarks.engine_steps", "daemon", *flags]

    def steps_file(self, i: int) -> Path:
        assert self.steps_dir is not None
        return self.steps_dir / f"daemon-{i}.json"

    @contextlib.contextmanager
    def engines(self, pins: Sequence[Pinning]) -> Iterator[list[Engine]]:
        env = {"TRANSFERD_ENGINE_HOST_RAILS": ",".join(rail_hosts(self.rails)),
               **engine_env(self.engine)}
        procs = []
        for i, pin in enumerate(pins):
            e = dict(env)
            if self.steps_dir is not None:
                e["BENCH_STEPS_OUT"] = str(self.steps_file(i))
            procs.append(ServerProcess(self._argv(), pin, name=f"daemon {i}", env=e))
        try:
            with ThreadPoolExecutor(max_workers=min(8, len(procs))) as pool:
                errors = [f.exception() for f in [pool.submit(p.start) for p in procs]]
            failed = [e for e in errors if e is not None]
            if failed:
                raise RuntimeError(f"a daemon did not start: {failed[0]}")
            yield [Engine(p.url, p.pid) for p in procs]
        finally:
            for p in procs:
                p.stop()


@dataclass
class Inproc:
    """Each node's engine in its role's own process (``inproc://``, issue 21), ``rails``
    loopback rails each; the engines are each other's peers over tcp, as daemons are.

    Nothing starts here: each role's ``Client.connect("inproc://")`` starts its engine,
    which reads its rails (and ``engine`` settings) from the role's environment
    (``role_env``) as a daemon would."""

    rails: int = 1
    engine: dict[str, str] = field(default_factory=dict)
    name: str = ""

    @property
    def label(self) -> str:
        return (f"inproc engines (each in its role's process) over tcp, {_rails(self.rails)} "
                f"each{_settings(self.engine)}")

    @property
    def arm(self) -> str:
        return self.name or "transferd inproc"

    @property
    def role_env(self) -> dict[str, str]:
        return {"TRANSFERD_ENGINE_HOST_RAILS": ",".join(rail_hosts(self.rails)),
                **engine_env(self.engine)}

    @contextlib.contextmanager
    def engines(self, pins: Sequence[Pinning]) -> Iterator[list[Engine]]:
        yield [Engine("inproc://") for _ in pins]


def placements(rails: int, engine: dict[str, str] | None = None) -> list[Placement]:
    """The placements every workload benchmark runs transferd on, each an arm of its own
    (``engine``: settings of every node's engine, on both)."""
    return [Daemons(rails=rails, engine=dict(engine or {})),
            Inproc(rails=rails, engine=dict(engine or {}))]


def _rails(n: int) -> str:
    return f"{n} rail{'s' if n > 1 else ''}"


def _settings(engine: dict[str, str]) -> str:
    return "".join(f", engine.{k} = {v}" for k, v in engine.items())


def load_steps(path: Path) -> list[tuple[str, int]]:
    """A daemon's step timestamps (engine_steps' dump), in time order."""
    return sorted(((str(t), int(v)) for t, v in json.loads(path.read_text())),
                  key=lambda e: e[1])


# -- roles ----------------------------------------------------------------------------------


class RoleProcess(PeerProcess):
    """One role of a workload module, in a process of its own, pinned; JSON lines.

    ``send`` + ``recv`` let the benchmark command several roles at once (every MoE rank
    starts its steps together); ``cmd`` is both."""

    def __init__(self, module: str, role: str, args: dict[str, Any], pinning: Pinning,
                 *, python: str | None = None, timeout: float = 120.0,
                 env: dict[str, str] | None = None) -> None:
        super().__init__("socket", role, 0, pinning, timeout=timeout)
        self.name = f"{module}.{role}"
        self.env = dict(env or {})
        self.argv = [python or sys.executable, "-m", "benchmarks.workloads_common", "role",
                     module, role, json.dumps(args)]

    def send(self, **c: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(c) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self, timeout: float | None = None) -> dict[str, Any]:
        return self._answer(timeout or self.timeout)


@contextlib.contextmanager
def roles(specs: Sequence[tuple[str, str, dict[str, Any], Pinning]],
          timeout: float = 120.0, python: str | None = None,
          env: dict[str, str] | None = None) -> Iterator[list[RoleProcess]]:
    """Start roles in order (a later one may need an earlier one's ready answer: start
    them in separate ``with`` blocks then); all stopped on the way out.  ``python``: the
    interpreter (the benchmark-only venv's for another engine's roles); ``env``: added to
    their environment."""
    started: list[RoleProcess] = []
    try:
        for module, role, args, pin in specs:
            r = RoleProcess(module, role, args, pin, timeout=timeout, python=python, env=env)
            started.append(r)
            r.start()
        yield started
    finally:
        for r in reversed(started):
            r.stop()


T = TypeVar("T")


def peer_arms(stack: contextlib.ExitStack, kinds: Sequence[str],
              start: Callable[[str], contextlib.AbstractContextManager[T]]
              ) -> tuple[list[T], dict[str, str]]:
    """The arm of each of ``kinds`` (another engine's) that starts, entered on ``stack`` in
    order; the others map to the reason they cannot."""
    arms: list[T] = []
    missing: dict[str, str] = {}
    for kind in kinds:
        try:
            arms.append(stack.enter_context(start(kind)))
        except PeerUnavailable as exc:
            missing[kind] = str(exc)
    return arms, missing


def all_of(procs: Sequence[RoleProcess], timeout: float | None = None, **c: Any
           ) -> list[dict[str, Any]]:
    """The same command to every role at once; their answers, in order."""
    for p in procs:
        p.send(**c)
    return [p.recv(timeout) for p in procs]


# -- inside a role's process ----------------------------------------------------------------


class ClientRole:
    """A role that is a client of its node's engine at ``url`` (any placement's URL)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client: Any = None

    async def connect(self) -> Any:
        """The role's connected :class:`client.Client`."""
        from client import Client

        self.client = await Client.connect(self.url)
        return self.client

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _call(fn: Any, **kw: Any) -> Any:
    out = fn(**kw)
    return await out if inspect.isawaitable(out) else out


async def _serve(module: str, role: str, args: dict[str, Any]) -> None:
    mod = importlib.import_module(f"benchmarks.{module}")
    obj = mod.ROLES[role](**args)
    try:
        ready = await _call(obj.setup)
    except Exception as exc:
        traceback.print_exc()
        _emit({"error": f"{type(exc).__name__}: {exc}"})
        return
    _emit({"ready": True, **(ready or {})})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            if not line.strip():
                continue
            cmd = json.loads(line)
            op = cmd.pop("op")
            try:
                out = await _call(getattr(obj, op), **cmd)
            except Exception as exc:
                traceback.print_exc()
                _emit({"error": f"{op}: {type(exc).__name__}: {exc}"})
                continue
            _emit(out or {})
    finally:
        close = getattr(obj, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await _call(close)


def role_main(argv: list[str]) -> None:
    module, role, args = argv[0], argv[1], json.loads(argv[2])
    try:
        import uvloop

        uvloop.run(_serve(module, role, args))
    except ImportError:  # the benchmark-only venv may lack it
        asyncio.run(_serve(module, role, args))


# -- numbers --------------------------------------------------------------------------------


def p50(xs: Sequence[float]) -> float:
    return percentile(xs, 50)


def p99(xs: Sequence[float]) -> float:
    return percentile(xs, 99)


TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process used so far, threads that ended included (/proc/PID/stat:
    utime + stime, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def load_now() -> tuple[float, float, float]:
    return os.getloadavg()


def load_note(start: tuple[float, float, float], end: tuple[float, float, float]) -> str:
    """The machine's load over a figure (it is shared: read every ratio against it)."""
    with contextlib.suppress(OSError):
        running = open("/proc/loadavg").read().split()[3]  # noqa: SIM115 - one read
        return (f"load average {start[0]:.2f} at the start, {end[0]:.2f} at the end "
                f"(1 min; 5 min {end[1]:.2f}); {running} tasks running at the end")
    return f"load average {start[0]:.2f} at the start, {end[0]:.2f} at the end"


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "role":
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        role_main(sys.argv[2:])
    else:
        print("usage: python -m benchmarks.workloads_common role MODULE ROLE ARGS-JSON",
              file=sys.stderr)
        sys.exit(2)
