"""The shared benchmark harness: processes, pinning, statistics, tables, targets.

Every benchmark module in this package is built from these pieces, so the
protocol figures (issue 2) and the engine figures that come later measure and
report the same way:

- :class:`Pinning` decides where processes run.  On this project's small,
  shared machines a latency figure moves a lot with placement, so every arm of
  a comparison is pinned the same way: servers on one CPU, the measuring
  client on another (when at least two CPUs are allowed).
- :class:`ServerProcess` starts a server as a subprocess (the real daemon via
  :func:`daemon_command`, or a baseline from :mod:`benchmarks.baselines`),
  pinned, and waits for ``transferd: listening on URL`` / ``transferd: ready``.
- :func:`percentile`, :func:`median` and :func:`summarize` for the numbers,
  :class:`Table` to print them, :class:`Check` for a target (PASS / MISS),
  :class:`BenchResult` for what a module returns (also written by ``--json``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import math
import os
import platform
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent

# -- options --------------------------------------------------------------------


@dataclass
class Options:
    """What ``python -m benchmarks`` hands each module."""

    quick: bool = False
    pinning: Pinning = field(default_factory=lambda: Pinning.detect())
    verbose: bool = False

    def pick(self, full: Any, quick: Any) -> Any:
        """``full`` normally, ``quick`` under ``--quick``."""
        return quick if self.quick else full

    def log(self, msg: str) -> None:
        if self.verbose:
            print(f"  .. {msg}", file=sys.stderr, flush=True)


# -- pinning --------------------------------------------------------------------


@dataclass(frozen=True)
class Pinning:
    """Where servers and the measuring client run.

    With two or more allowed CPUs the servers (daemon and baselines alike) get
    the first allowed CPU and the client (this process) the second; with one
    CPU everything shares it; ``none`` leaves placement to the scheduler.
    """

    server: frozenset[int] | None
    client: frozenset[int] | None
    allowed: frozenset[int]

    @classmethod
    def detect(cls, enabled: bool = True) -> Pinning:
        allowed = frozenset(os.sched_getaffinity(0))
        if not enabled:
            return cls(None, None, allowed)
        cpus = sorted(allowed)
        if len(cpus) >= 2:
            return cls(frozenset({cpus[0]}), frozenset({cpus[1]}), allowed)
        return cls(frozenset(cpus), frozenset(cpus), allowed)

    def pin_client(self) -> None:
        """Pin the calling process (the measuring client)."""
        if self.client is not None:
            os.sched_setaffinity(0, self.client)

    def server_preexec(self) -> Callable[[], None] | None:
        """For ``subprocess.Popen(preexec_fn=...)``: pins the child before exec."""
        cpus = self.server
        if cpus is None:
            return None
        return lambda: os.sched_setaffinity(0, cpus)

    def describe(self) -> str:
        if self.server is None or self.client is None:
            return f"not pinned (allowed CPUs {_cpus(self.allowed)})"
        if self.server == self.client:
            return f"everything on CPU {_cpus(self.server)} (only one CPU allowed)"
        return (
            f"servers on CPU {_cpus(self.server)}, client on CPU {_cpus(self.client)} "
            f"(sched_setaffinity; allowed CPUs {_cpus(self.allowed)})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "server": sorted(self.server) if self.server is not None else None,
            "client": sorted(self.client) if self.client is not None else None,
            "allowed": sorted(self.allowed),
            "description": self.describe(),
        }


def _cpus(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


# -- server processes -----------------------------------------------------------

LISTEN_RE = re.compile(r"transferd: listening on (\S+)")
READY_LINE = "transferd: ready"


def daemon_command(*args: str) -> list[str]:
    """The real daemon, as ``make run`` would start it: ``rpc-server`` of this venv."""
    exe = Path(sys.executable).parent / "rpc-server"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "rpc_server.cli"]
    return [*base, "-H", "127.0.0.1", "-p", "0", "--metrics-port", "-1", *args]


def baseline_command(kind: str, *args: str) -> list[str]:
    """A baseline server of :mod:`benchmarks.baselines` (same readiness lines)."""
    return [sys.executable, "-m", "benchmarks.baselines", kind, *args]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a server: no TRANSFERD_* leaking in from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class ServerProcess:
    """A server subprocess, pinned, started and waited for; ``with`` stops it.

    The child must print ``transferd: listening on URL`` and then
    ``transferd: ready`` on stdout (the daemon does; so do the baselines).
    """

    def __init__(
        self,
        argv: Sequence[str],
        pinning: Pinning,
        *,
        name: str = "",
        env: dict[str, str] | None = None,
        ready_timeout: float = 30.0,
    ) -> None:
        self.argv = list(argv)
        self.name = name or Path(self.argv[0]).name
        self.pinning = pinning
        self.env = clean_env(env)
        self.ready_timeout = ready_timeout
        self.urls: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[str] | None = None

    @property
    def url(self) -> str:
        tcp = [u for u in self.urls if u.startswith("tcp://")]
        return (tcp or self.urls)[0]

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.url.removeprefix("tcp://").rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> ServerProcess:
        # Closed by stop(); it outlives this method on purpose.
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=REPO,
            preexec_fn=self.pinning.server_preexec(),
        )
        assert self.proc.stdout is not None
        # Read the raw pipe (a text wrapper's read-ahead would hide lines from select).
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + self.ready_timeout
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        pending = b""
        try:
            ready = False
            while not ready:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{self.name}: not ready after {self.ready_timeout:g} s")
                if not sel.select(left):
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"{self.name} exited early: {self._tail()}")
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace").strip()
                    m = LISTEN_RE.search(line)
                    if m:
                        self.urls.append(m.group(1))
                    if line == READY_LINE:
                        ready = True
        except BaseException:
            self.stop()
            raise
        finally:
            sel.close()
        if not self.urls:
            self.stop()
            raise RuntimeError(f"{self.name}: ready but printed no listening address")
        return self

    def _tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read()[-2000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_daemon(pinning: Pinning, *args: str, name: str = "rpc-server") -> ServerProcess:
    return ServerProcess(daemon_command(*args), pinning, name=name).start()


# -- numbers --------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100), linear between closest ranks."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    k = (len(xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def summarize(values: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "min": min(values) if values else math.nan,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else math.nan,
        "mean": sum(values) / len(values) if values else math.nan,
    }


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """Collect before a timed region so no arm pays for another's garbage."""
    gc.collect()
    yield


def interleave(arms: Sequence[Any], rounds: int) -> Iterator[tuple[int, Any]]:
    """(round, arm) in alternating order: ABC, CBA, ABC ... cancels slow drifts."""
    for r in range(rounds):
        order = arms if r % 2 == 0 else list(reversed(arms))
        for arm in order:
            yield r, arm


# -- reporting ------------------------------------------------------------------


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def fmt_ratio(x: float) -> str:
    return f"{x:.2f}x" if math.isfinite(x) else "-"


def fmt_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 2**20:,.0f}"


@dataclass
class Check:
    """One target: ``value`` compared with ``limit`` by ``op`` ('<=' or '>=' or '==')."""

    name: str
    value: float
    op: str
    limit: float
    unit: str = ""

    @property
    def passed(self) -> bool:
        if self.op == "<=":
            return self.value <= self.limit
        if self.op == ">=":
            return self.value >= self.limit
        if self.op == "==":
            return math.isclose(self.value, self.limit, rel_tol=1e-9, abs_tol=1e-9)
        raise ValueError(self.op)

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "MISS"

    def line(self) -> str:
        v = f"{self.value:.3g}{self.unit}"
        return f"{self.verdict}  {self.name}: {v} (target {self.op} {self.limit:g}{self.unit})"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[Any]] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append(list(cells))

    def render(self, markdown: bool = False) -> str:
        cells = [[str(c) for c in row] for row in self.rows]
        if markdown:
            out = [f"| {' | '.join(self.headers)} |", f"|{'|'.join('---' for _ in self.headers)}|"]
            out += [f"| {' | '.join(r)} |" for r in cells]
            return "\n".join(out)
        widths = [len(h) for h in self.headers]
        for r in cells:
            for i, c in enumerate(r):
                widths[i] = max(widths[i], len(c))

        def line(r: list[str]) -> str:
            parts = [c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)]
            return "  ".join(parts).rstrip()

        sep = "  ".join("-" * w for w in widths)
        return "\n".join([self.title, line(self.headers), sep, *(line(r) for r in cells)])

    def to_json(self) -> dict[str, Any]:
        return {"title": self.title, "headers": self.headers, "rows": self.rows}


@dataclass
class BenchResult:
    name: str
    title: str
    section: str  # the docs/benchmarks.md section it belongs to, e.g. "Protocol (issue 2)"
    tables: list[Table] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def render(self, markdown: bool = False) -> str:
        parts = [f"== {self.name}: {self.title} =="]
        for t in self.tables:
            parts.append(t.render(markdown))
        if self.checks:
            parts.append("\n".join(c.line() for c in self.checks))
        parts += [f"note: {n}" for n in self.notes]
        parts.append(f"({self.seconds:.1f} s)")
        return "\n\n".join(parts)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "section": self.section,
            "tables": [t.to_json() for t in self.tables],
            "checks": [c.to_json() for c in self.checks],
            "notes": self.notes,
            "data": self.data,
            "seconds": self.seconds,
        }


# -- the machine ----------------------------------------------------------------


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "?"


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def machine_info(pinning: Pinning) -> dict[str, Any]:
    return {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "allowed_cpus": sorted(pinning.allowed),
        "cpu_model": cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "uvloop": _version("uvloop"),
        "msgpack": _version("msgpack"),
        "transferd": _version("transferd"),
        "pinning": pinning.to_json(),
        "loadavg": os.getloadavg(),
    }
