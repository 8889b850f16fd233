"""What ``transferd bench`` runs: its own daemons, the operations it times, one size's run.

Every remote resource it takes (a buffer and a registered region on each daemon) is
given back on the way out, whatever the way: done, an error, SIGINT or SIGTERM (the
command turns both into :class:`Stopped` and cleans up before it exits).  Transfers
still in flight are awaited (bounded) before their buffers go, and every task's
outcome is collected, so nothing is left for asyncio to report as never retrieved.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import hashlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

#: Percentiles reported per size, as (name, quantile).
PERCENTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99), ("p999", 0.999))
#: Seconds the clean-up may wait for transfers still in flight before it frees their
#: buffers anyway (the daemon refuses to land in freed memory).
SETTLE_S = 10.0


class Stopped(Exception):
    """SIGINT or SIGTERM: stop timing, clean up, exit 128 + signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class BenchError(Exception):
    """A failure the operator is told about in one line (exit 1)."""


# -- the daemons it starts -----------------------------------------------------------


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """The child gets SIGTERM when the bench dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def daemon(rail: str, mem_mib: int, secret: dict[str, str]) -> Iterator[str]:
    """An ``rpc-server`` whose engine rail is on ``rail`` (its RPC port on loopback, for
    the bench alone; ``secret``: its TRANSFERD_ENGINE_SECRET* variable), stopped on the
    way out; yields its RPC URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    env.update(secret, PYTHONUNBUFFERED="1", TRANSFERD_ENGINE_HOST_RAILS=rail)
    with tempfile.TemporaryFile(mode="w+") as err:
        p = subprocess.Popen(
            [sys.executable, "-m", "rpc_server.cli", "-H", "127.0.0.1", "-p", "0",
             "--metrics-port", "-1", "-m", str(mem_mib), "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=err, text=True, env=env, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent)
        url: list[str] = []
        ready = threading.Event()

        def read() -> None:  # reads stdout to its end, so the daemon never blocks on it
            assert p.stdout is not None
            for line in p.stdout:
                if line.startswith("transferd: listening on tcp://") and not url:
                    url.append(line.split()[-1])
                if line.strip() == "transferd: ready":
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        try:
            ready.wait(30)
            if not url or p.poll() is not None:
                err.seek(0)
                why = err.read().strip().splitlines()
                raise BenchError(f"a bench daemon did not start (rail {rail}): "
                                 f"{why[-1] if why else 'no output'}")
            yield url[0]
        finally:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def local_address_towards(url: str) -> str:
    """The address of this machine that reaches the host of ``url`` (where the daemon
    the bench starts must put its rail for that peer to answer it)."""
    from transferd import transports

    ep = transports.parse(url)
    host = ep.host or "127.0.0.1"
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1" if ":" not in host else "::1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, ep.port or 9))  # a UDP connect sends nothing: a route look-up
        except OSError as exc:
            raise BenchError(f"no route to {host}: {exc.strerror or exc}") from None
        return str(s.getsockname()[0])


# -- what it times -------------------------------------------------------------------


class Operation(Protocol):
    """One kind of transfer the bench times (``--op``)."""

    name: str
    access: str

    def missing(self, source: Any) -> str | None:
        """Why this build or this daemon cannot do it, or None."""

    async def start(self, source: Any, size: int, local: Any, remote: Any) -> Any:
        """Submit one transfer of ``size`` bytes; return what ``await x.wait()`` ends."""


class Write:
    """One-sided writes: the local region's bytes into the remote one."""

    name = "write"
    access = "w"  # what the remote region must grant

    def missing(self, source: Any) -> str | None:
        return None if "engine" in source.features else "the source daemon has no engine"

    async def start(self, source: Any, size: int, local: Any, remote: Any) -> Any:
        return await source.submit_single_write(size, None, (local, 0), (remote, 0))


class Read:
    """One-sided reads (issue 19): the remote region's bytes into the local one.

    A daemon without the feature (HELLO's ``read``) is told apart by :meth:`missing`,
    and nothing is submitted.
    """

    name = "read"
    access = "r"

    def missing(self, source: Any) -> str | None:
        if not hasattr(source, "submit_single_read"):
            return "one-sided READ is not in this build (it comes with issue 19)"
        if "read" not in source.features:
            return "the source daemon does not offer one-sided READ (HELLO features)"
        return None

    async def start(self, source: Any, size: int, local: Any, remote: Any) -> Any:
        return await source.submit_single_read(size, (local, 0), (remote, 0))


OPERATIONS: dict[str, Operation] = {"write": Write(), "read": Read()}


# -- one size --------------------------------------------------------------------------


@dataclass
class SizeResult:
    size: int
    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list, repr=False)
    series: list[tuple[float, int]] = field(default_factory=list, repr=False)
    verified: bool = False

    def to_dict(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(q: float) -> float:
            return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 if lat else 0.0

        out: dict[str, Any] = {
            "size": self.size, "transfers": self.transfers, "bytes": self.bytes,
            "seconds": self.seconds,
            "gib_per_s": self.bytes / self.seconds / (1 << 30) if self.seconds else 0.0,
            "gbps": self.bytes * 8 / self.seconds / 1e9 if self.seconds else 0.0,
            "transfers_per_s": self.transfers / self.seconds if self.seconds else 0.0,
            "min_ms": lat[0] * 1e3 if lat else 0.0,
            "mean_ms": sum(lat) / len(lat) * 1e3 if lat else 0.0,
        }
        out.update({f"{name}_ms": pct(q) for name, q in PERCENTILES})
        out["max_ms"] = lat[-1] * 1e3 if lat else 0.0
        out["verified"] = self.verified
        out["series"] = self.series
        return out


@dataclass
class Pair:
    """The two daemons, and what the bench holds on each (given back by :meth:`close`)."""

    source: Any
    destination: Any
    held: list[Callable[[], Any]] = field(default_factory=list)
    local_mr: Any = None
    remote_desc: Any = None
    local_buf: Any = None
    remote_buf: Any = None

    async def take(self, size: int, access: str = "w") -> None:
        """A buffer of ``size`` on each side, filled with random bytes, registered."""
        a, b = self.source, self.destination
        # The connection's: a bench killed before its clean-up (SIGKILL) leaves nothing
        # on the daemons, which free what a closed connection owned.
        self.local_buf = await a.alloc_buffer(size, owner="connection")
        self.held.append(functools.partial(a.free_buffer, self.local_buf))
        self.remote_buf = await b.alloc_buffer(size, owner="connection")
        self.held.append(functools.partial(b.free_buffer, self.remote_buf))
        await a.set_tensor(self.local_buf.tensor(), os.urandom(size))
        await b.set_tensor(self.remote_buf.tensor(), os.urandom(size))
        self.local_mr, _ = await a.reg_mr(self.local_buf)
        self.held.append(functools.partial(a.dereg_mr, self.local_mr))
        # (The remote region grants what the operation needs of it: "r" for reads.)
        remote_mr, self.remote_desc = await b.reg_mr(self.remote_buf, access)
        self.held.append(functools.partial(b.dereg_mr, remote_mr))

    async def same(self, size: int) -> bool:
        """The first ``size`` bytes of the two buffers are equal (sha256)."""
        mine = bytes(await self.source.get_tensor(self.local_buf.tensor(0, size)))
        theirs = bytes(await self.destination.get_tensor(self.remote_buf.tensor(0, size)))
        return hashlib.sha256(mine).digest() == hashlib.sha256(theirs).digest()

    async def close(self) -> list[str]:
        """Give back everything held, newest first; what could not be, as text."""
        problems = []
        while self.held:
            undo = self.held.pop()
            try:
                await asyncio.wait_for(undo(), 10)
            except Exception as exc:  # one failure must not keep the rest
                problems.append(str(exc) or type(exc).__name__)
        return problems


class InFlight:
    """The transfers running now; each one's outcome is taken, none is left behind."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.tasks: set[asyncio.Task[float]] = set()

    def add(self, coro: Any) -> None:
        self.tasks.add(asyncio.ensure_future(coro))

    async def next_done(self) -> list[float]:
        """Latencies of those that finished first (none when ``stop`` was set
        meanwhile); raises the first failure, after taking the others' outcomes."""
        waiter = asyncio.ensure_future(self.stop.wait())
        try:
            done, _ = await asyncio.wait(self.tasks | {waiter},
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
        done.discard(waiter)
        self.tasks -= done
        return self._outcomes(done)

    async def settle(self, timeout: float = SETTLE_S) -> None:
        """Wait for every transfer still running (at most ``timeout``), cancel the rest;
        their outcomes are taken and dropped."""
        if self.tasks:
            _, pending = await asyncio.wait(self.tasks, timeout=timeout)
            for t in pending:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = set()

    @staticmethod
    def _outcomes(done: set[Any]) -> list[float]:
        first: BaseException | None = None
        out = []
        for t in done:
            if t.cancelled():
                continue
            exc = t.exception()
            if exc is None:
                out.append(t.result())
            elif first is None:
                first = exc
        if first is not None:
            raise first
        return out


async def run_size(pair: Pair, op: Operation, size: int, window: int, duration: float,
                   warmup: int, stop: asyncio.Event, progress: Callable[[float], None],
                   timeout: float = 30.0) -> SizeResult:
    """``window`` transfers of ``size`` in flight for ``duration`` s (after ``warmup``
    untimed ones), then the bytes compared.  ``progress`` gets the share of the time
    done (0 to 1, and 1 at the end).  ``stop`` set (a signal): raises :class:`Stopped`
    once what is in flight settled."""
    result = SizeResult(size)
    flight = InFlight(stop)

    async def one() -> float:
        t = time.perf_counter()
        c = await op.start(pair.source, size, pair.local_mr, pair.remote_desc)
        await c.wait(timeout)
        return time.perf_counter() - t

    def landed(latencies: list[float]) -> None:
        result.latencies += latencies
        result.transfers += len(latencies)
        result.bytes += len(latencies) * size

    try:
        started = 0
        while started < warmup and not stop.is_set():
            flight.add(one())
            started += 1
            if len(flight.tasks) >= window:
                await flight.next_done()
        while flight.tasks and not stop.is_set():
            await flight.next_done()
        t0 = time.perf_counter()
        end = t0 + duration
        last = t0
        while not stop.is_set() and time.perf_counter() < end:
            while len(flight.tasks) < window:
                flight.add(one())
            landed(await flight.next_done())
            now = time.perf_counter()
            if now - last >= 0.1:
                result.series.append((now - t0, result.bytes))
                progress(min(1.0, (now - t0) / duration))
                last = now
        # What is in flight at the end was started in the time: it counts.
        while flight.tasks and not stop.is_set():
            landed(await flight.next_done())
        result.seconds = time.perf_counter() - t0
        result.series.append((result.seconds, result.bytes))
    finally:
        await flight.settle(timeout)
    if stop.is_set():
        raise Stopped(getattr(stop, "signum", signal.SIGINT))
    progress(1.0)
    # Either way the two buffers began different (random) and must now match.
    result.verified = await pair.same(size)
    return result
