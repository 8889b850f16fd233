"""What the engine figures (issue 3) share: placement, daemon pairs, peer processes.

Placement.  Every engine figure has an initiator side and a target side.  With
two or more allowed CPUs the initiator side runs on the first allowed CPU and
the target side on the second, for every arm alike: daemon A, and the client
that drives it (this process, re-pinned for the measurement), or the
initiator process of a baseline / Mooncake / NIXL, on one CPU; daemon B or the
target process on the other.  A daemon's worker thread stays inside its
process's CPU set (the engine picks its core within ``sched_getaffinity``).
With one CPU everything shares it; ``--no-pin`` pins nothing.

Peers.  :class:`PeerProcess` runs one role of :mod:`benchmarks.engine_peers`
(plain sockets in this venv; Mooncake and NIXL in the benchmark-only venv,
``.bench-venv`` or ``$TRANSFERD_BENCH_VENV``) and talks JSON lines to it.  When
an engine does not import or start, :class:`PeerUnavailable` carries the
reason the report prints as "not available: <reason>".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

from .engine_peers import fill_chunks
from .harness import REPO, Options, Pinning, ServerProcess, clean_env, daemon_command

SECTION = "Transfer engine (issue 3)"
PEERS_SCRIPT = REPO / "benchmarks" / "engine_peers.py"
MiB = 1 << 20
GiB = 1 << 30


# -- placement ----------------------------------------------------------------------


@dataclass(frozen=True)
class Sides:
    initiator: Pinning  # .server is the initiator side's CPU set (None: not pinned)
    target: Pinning

    def describe(self) -> str:
        i, t = self.initiator.server, self.target.server
        if i is None or t is None:
            return "not pinned (--no-pin)"
        if i == t:
            return f"initiator and target sides both on CPU {_cpus(i)} (one CPU allowed)"
        return (f"initiator side (daemon A + its client, or the baseline's initiator "
                f"process) on CPU {_cpus(i)}, target side (daemon B, or the target "
                f"process) on CPU {_cpus(t)}; sched_setaffinity before exec")


def _cpus(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def sides(opts: Options) -> Sides:
    allowed = opts.pinning.allowed
    if opts.pinning.server is None:
        none = Pinning(None, None, allowed)
        return Sides(none, none)
    cpus = sorted(allowed)
    first = frozenset(cpus[:1])
    second = frozenset(cpus[1:2]) or first
    return Sides(Pinning(first, first, allowed), Pinning(second, second, allowed))


@contextlib.contextmanager
def client_on(pinning: Pinning) -> Iterator[None]:
    """Run this process (the measuring client) on ``pinning``'s CPUs for a while."""
    before = os.sched_getaffinity(0)
    if pinning.server is not None:
        os.sched_setaffinity(0, pinning.server)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# -- transferd ---------------------------------------------------------------------------


def start_pair(s: Sides, *args: str, env: dict[str, str] | None = None,
               a_args: Sequence[str] = ()) -> tuple[ServerProcess, ServerProcess]:
    """Daemon A (initiator side) and daemon B (target side) on loopback, one rail each;
    ``env`` for both (TRANSFERD_ENGINE_WORKER=thread, say), ``a_args`` for A only."""
    a = ServerProcess(daemon_command(*args, *a_args), s.initiator, name="daemon A",
                      env=env).start()
    try:
        b = ServerProcess(daemon_command(*args), s.target, name="daemon B", env=env).start()
    except BaseException:
        a.stop()
        raise
    return a, b


def vm_status(pid: int) -> dict[str, int]:
    """VmHWM (peak resident) and VmRSS of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                out["hwm" if line.startswith("VmHWM") else "rss"] = int(line.split()[1]) * 1024
    return out


async def fill_remote(client: Any, buf: Any, size: int) -> int:
    """Write :func:`fill_chunks` into a daemon buffer; returns the CRC-32 of it."""
    crc = 0
    for off, chunk in fill_chunks(size):
        await client.set_tensor(buf.tensor(off, len(chunk)), chunk)
        crc = zlib.crc32(chunk, crc)
    return crc


async def crc_remote(client: Any, buf: Any, size: int, step: int = 64 * MiB) -> int:
    out = bytearray(min(step, size))
    crc = 0
    for off in range(0, size, step):
        n = min(step, size - off)
        view = memoryview(out)[:n]
        await client.get_tensor(buf.tensor(off, n), out=view)
        crc = zlib.crc32(view, crc)
    return crc


async def write_rtts(client: Any, mr: Any, desc: Any, size: int, n: int) -> list[float]:
    """``n`` sequential writes of ``size`` bytes from region ``mr`` (offset 0) to
    ``desc`` (offset 0), each timed from its submit to its completion (seconds)."""
    submit = client.submit_single_write
    src, dst = (mr, 0), (desc, 0)
    clock = time.perf_counter
    out = []
    for _ in range(n):
        t0 = clock()
        await (await submit(size, None, src, dst))
        out.append(clock() - t0)
    return out


def run_loop(coro: Any) -> Any:
    import uvloop

    return uvloop.run(coro)


def wait(coro: Any, timeout: float) -> Any:
    return asyncio.wait_for(coro, timeout)


# -- peer processes ----------------------------------------------------------------------


class PeerUnavailable(RuntimeError):
    """An engine that does not install, import or start here; str() is the reason."""


def bench_python() -> Path | None:
    """The benchmark-only venv's python (Mooncake, NIXL), if there is one."""
    root = os.environ.get("TRANSFERD_BENCH_VENV") or str(REPO / ".bench-venv")
    exe = Path(root) / "bin" / "python"
    return exe if exe.exists() else None


def peer_python(kind: str) -> str:
    if kind == "socket":
        return sys.executable
    exe = bench_python()
    if exe is None:
        raise PeerUnavailable(
            "no benchmark venv (make bench-venv, or set TRANSFERD_BENCH_VENV)")
    return str(exe)


PEER_ENV = {
    # NIXL over UCX, TCP only, on loopback (no RDMA, no shared memory transports).
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "lo",
    "UCX_LOG_LEVEL": "error",
    "NIXL_LOG_LEVEL": "ERROR",
    # Mooncake: glog to stderr only, warnings and up.
    "GLOG_minloglevel": "1",
    "GLOG_logtostderr": "1",
}


class PeerProcess:
    """One role of engine_peers.py, pinned; JSON commands in, JSON answers out."""

    def __init__(self, kind: str, role: str, size: int, pinning: Pinning,
                 args: Sequence[str] = (), timeout: float = 60.0) -> None:
        self.kind = kind
        self.name = f"{kind}-{role}"
        self.argv = [peer_python(kind), str(PEERS_SCRIPT), self.name, "--size", str(size),
                     *args]
        self.pinning = pinning
        self.timeout = timeout
        self.env: dict[str, str] = {}  # added to PEER_ENV (a subclass's tuning)
        self.proc: subprocess.Popen[bytes] | None = None
        self._err: IO[str] | None = None
        self._pending = b""
        self.ready: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> PeerProcess:
        self._err = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
            env=clean_env({**PEER_ENV, **self.env}), cwd=REPO,
            preexec_fn=self.pinning.server_preexec(),
        )
        try:
            self.ready = self._answer(self.timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _answer(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                while b"\n" in self._pending:
                    raw, self._pending = self._pending.split(b"\n", 1)
                    try:
                        msg = json.loads(raw)
                    except ValueError:
                        continue  # an engine's own chatter on stdout
                    if not isinstance(msg, dict):
                        continue
                    if "error" in msg:
                        raise PeerUnavailable(f"{self.name}: {msg['error']}")
                    return msg
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerUnavailable(f"{self.name}: no answer in {timeout:g} s")
                if not sel.select(left):
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise PeerUnavailable(f"{self.name} exited: {self.stderr_tail()}")
                self._pending += chunk

    def cmd(self, timeout: float | None = None, **c: Any) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(c) + "\n").encode())
        self.proc.stdin.flush()
        return self._answer(timeout or self.timeout)

    def stderr_tail(self, n: int = 400) -> str:
        if self._err is None:
            return ""
        self._err.seek(0)
        lines = [ln for ln in self._err.read().splitlines() if ln.strip()]
        return " | ".join(lines[-3:])[-n:] or "(no output)"

    def stop(self) -> None:
        p = self.proc
        if p is not None:
            with contextlib.suppress(OSError):
                if p.stdin is not None:
                    p.stdin.close()
            try:
                p.wait(3)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(3)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(3)
            if p.stdout is not None:
                p.stdout.close()
        if self._err is not None:
            self._err.close()
            self._err = None


class PeerPair:
    """A target and an initiator of one kind; ``bulk``/``lat`` ask the initiator."""

    def __init__(self, kind: str, size: int, s: Sides, timeout: float = 90.0,
                 extra: Sequence[str] = ()) -> None:
        """``extra``: more arguments for the initiator (NIXL's ``--xfer READ``)."""
        self.kind = kind
        self.size = size
        self.target = PeerProcess(kind, "t", size, s.target, timeout=timeout).start()
        try:
            t = self.target.ready
            if kind == "socket":
                args = ["--peer-port", str(t["port"])]
            elif kind == "mooncake":
                args = ["--session", t["session"], "--addr", str(t["addr"])]
            else:
                args = ["--meta", t["meta"], "--addr", str(t["addr"])]
            self.initiator = PeerProcess(kind, "i", size, s.initiator, [*args, *extra],
                                         timeout=timeout).start()
        except BaseException:
            self.target.stop()
            raise
        self.source_crc = int(self.initiator.ready["crc"])
        self.paused = False

    def bulk(self, size: int) -> float:
        return float(self.initiator.cmd(op="bulk", size=size)["s"])

    def lat(self, n: int, size: int) -> list[float]:
        return [float(x) for x in self.initiator.cmd(op="lat", n=n, size=size)["s"]]

    def target_crc(self, size: int) -> int:
        return int(self.target.cmd(op="crc", size=size)["crc"])

    def memory(self) -> dict[str, dict[str, int]]:
        return {"initiator": vm_status(self.initiator.pid), "target": vm_status(self.target.pid)}

    def pause(self, paused: bool = True) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) both processes.  An idle NIXL pair is
        not idle: UCX's progress busy-polls (29 % of the initiator's CPU and 36 % of the
        target's with nothing asked of it, issue 21's wave 3), which takes those CPUs
        from whichever arm is measured meanwhile; see :func:`only_running`."""
        if paused == self.paused:
            return
        sig = signal.SIGSTOP if paused else signal.SIGCONT
        for proc in (self.initiator, self.target):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
        self.paused = paused

    def stop(self) -> None:
        self.pause(False)  # a stopped process would not hear its end
        self.initiator.stop()
        self.target.stop()


@contextlib.contextmanager
def pair_and_floor(s: Sides, size: int, notes: list[str]
                   ) -> Iterator[tuple[ServerProcess, ServerProcess, PeerPair | None]]:
    """Daemons A and B (:func:`start_pair`) and the plain-socket floor of ``size`` bytes
    (None where it cannot start, the reason added to ``notes``); all stopped after."""
    a, b = start_pair(s)
    sock: PeerPair | None = None
    try:
        try:
            sock = PeerPair("socket", size, s)
        except PeerUnavailable as exc:
            notes.append(f"plain socket floor not available: {exc}")
        yield a, b, sock
    finally:
        if sock is not None:
            sock.stop()
        a.stop()
        b.stop()


def only_running(pairs: Iterable[PeerPair], running: object = None) -> None:
    """Every baseline pair but ``running`` (a PeerPair, or anything else: none of them)
    paused, that one continued: each arm is measured with no other arm's process
    runnable."""
    for pair in pairs:
        pair.pause(pair is not running)


def start_peers(kinds: Sequence[str], size: int, s: Sides, log: Any
                ) -> tuple[dict[str, PeerPair], dict[str, str]]:
    """Start every kind that can; the rest map to the reason they cannot."""
    pairs: dict[str, PeerPair] = {}
    missing: dict[str, str] = {}
    for kind in kinds:
        try:
            pairs[kind] = PeerPair(kind, size, s)
            log(f"{kind}: ready")
        except PeerUnavailable as exc:
            missing[kind] = str(exc)
            log(f"{kind}: not available: {exc}")
    return pairs, missing


LABELS = {"socket": "plain socket", "mooncake": "Mooncake TE (tcp)", "nixl": "NIXL (UCX tcp)"}


# -- every arm of a figure ------------------------------------------------------------------


class TransferdArm:
    """A figure's transferd arm: a client of daemon A (``ca``) and one of daemon B
    (``cb``) in this process, on a uvloop of its own, with ``size`` bytes allocated on
    each and registered: A's ``src`` as region ``mr``, B's ``dst`` as ``desc``.

    :meth:`fill` (before registering) sets what the two buffers hold; ``access`` is what
    B's ``dst`` is registered for ("rw": read arms pull its bytes back into ``src``).
    """

    access = "w"

    def __init__(self, a_url: str, b_url: str, size: int) -> None:
        import uvloop

        self.a_url, self.b_url, self.size = a_url, b_url, size
        self.loop = uvloop.new_event_loop()

    def setup(self) -> None:
        self.loop.run_until_complete(self._setup())

    async def _setup(self) -> None:
        from client import Client

        self.ca = await Client.connect(self.a_url)
        self.cb = await Client.connect(self.b_url)
        self.src = await self.ca.alloc_buffer(self.size)
        self.dst = await self.cb.alloc_buffer(self.size)
        await self.fill()
        self.mr, _ = await self.ca.reg_mr(self.src)
        _, self.desc = await self.cb.reg_mr(self.dst, self.access)

    async def fill(self) -> None:
        """Zero B's buffer (which touches every destination page)."""
        await self.cb.buffer_clear(self.dst, 0)

    def close(self) -> None:
        async def close() -> None:
            for c in (getattr(self, "ca", None), getattr(self, "cb", None)):
                if c is not None:
                    await c.close()

        self.loop.run_until_complete(close())
        self.loop.close()


class FilledArm(TransferdArm):
    """A transferd arm whose ``src`` holds :func:`fill_chunks` (its CRC-32 in
    ``source_crc``), written before B's ``dst`` is zeroed."""

    async def fill(self) -> None:
        self.source_crc = await fill_remote(self.ca, self.src, self.size)
        await super().fill()


T = TypeVar("T", bound=TransferdArm)


@dataclass
class Arms(Generic[T]):
    """Daemons A and B, the transferd arm that drives them, and the peers that started."""

    a: ServerProcess
    b: ServerProcess
    transferd: T
    pairs: dict[str, PeerPair]
    missing: dict[str, str]  # kind -> why it is not available

    @property
    def by_label(self) -> dict[str, Any]:
        """Every arm, transferd first, keyed by the label the report shows."""
        return {"transferd": self.transferd,
                **{LABELS[kind]: pair for kind, pair in self.pairs.items()}}


@contextlib.contextmanager
def start_arms(s: Sides, make: Callable[[str, str], T], kinds: Sequence[str], size: int,
               log: Any) -> Iterator[Arms[T]]:
    """Daemons A and B, ``make(a_url, b_url)`` set up on the initiator's CPUs, and a
    :class:`PeerPair` of ``size`` bytes for every one of ``kinds`` that starts; all
    closed and stopped on the way out."""
    a = b = None
    td: T | None = None
    pairs: dict[str, PeerPair] = {}
    try:
        a, b = start_pair(s)
        with client_on(s.initiator):
            td = make(a.url, b.url)
            td.setup()
        log("transferd: ready")
        pairs, missing = start_peers(kinds, size, s, log)
        yield Arms(a, b, td, pairs, missing)
    finally:
        if td is not None:
            td.close()
        for pair in pairs.values():
            pair.stop()
        for d in (a, b):
            if d is not None:
                d.stop()
