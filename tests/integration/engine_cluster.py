"""Shared set-up for the engine tests: daemons with two rails each on loopback aliases.

Daemon A's rails are 127.0.0.2 and 127.0.0.3, B's 127.0.0.4 and .5, C's .6 and .7 (all
of 127.0.0.0/8 is loopback on Linux).  ``clusters`` (session scope) keeps one trio per
domain ("tcp" or "chaos") for every test that leaves its daemons as it found them;
``cluster`` hands one to a test, parametrized over both domains, both kinds of worker and
the three client transports (paired, not crossed: tcp on the daemon's loop over tcp, chaos
on two thread-worker groups over unix, tcp on a thread worker over seqpacket -- the domain
and the worker work between daemons and the client transport between a client and its
daemon, so each of them once covers all at a third of the cross product's cost), and
checks that all three daemons survived.  :func:`nodes` connects over the client transport of the
``cluster`` in use (tcp outside it).  Tests that kill or stop a daemon start their own with
:func:`start_many`.

Counters and receive backlogs belong to a daemon, so tests sharing a cluster take fresh
immediates from :func:`fresh_imm` and consume every message they send.

A test module takes the fixtures by assignment (``cluster = engine_cluster.cluster``,
and the same for ``clusters``, ``tcp_cluster`` and ``own_daemons``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from client import Client, MrDesc, MrHandle, NetAddr, RemoteBuffer
from tests.helpers import REPO, DaemonProcess, metric, pattern, scrape, wait_until
from transferd.domains.rails import parse_rail

DOMAINS = ("tcp", "chaos")
# The session's trios by name: (domain, engine settings).  "tcp" is the default
# engine (one host group on the daemon's loop); the others run their groups on
# worker threads (engine.worker = "thread"), chaos's in two groups.
TRIOS: dict[str, tuple[str, dict[str, Any]]] = {
    "tcp": ("tcp", {}),
    "chaos": ("chaos", {"worker": "thread", "host_groups": 2}),
    "tcp-thread": ("tcp", {"worker": "thread"}),
}
# (trio, client transport) of each ``cluster`` parameter.
CLUSTER_PARAMS = (("tcp", "tcp"), ("chaos", "unix"), ("tcp-thread", "seqpacket"))
RAILS = {
    "a": ("127.0.0.2", "127.0.0.3"),
    "b": ("127.0.0.4", "127.0.0.5"),
    "c": ("127.0.0.6", "127.0.0.7"),
}
MiB = 1 << 20
# How long a test waits for one completion before calling it a hang.
WAIT = 20.0
# The shared trios prove this cluster secret to each other (as a deployment
# would); daemons a test starts without one are on loopback rails only.
SECRET = b"engine-cluster test secret"
# Short, so that a test of a handshake that never ends does not wait long.
HANDSHAKE_TIMEOUT_S = 2.0
_SECRET_DIR = tempfile.mkdtemp(prefix="transferd-secret-")
atexit.register(shutil.rmtree, _SECRET_DIR, True)


def secret_file(secret: bytes = SECRET) -> str:
    """A file holding ``secret`` (mode 0600), for engine.secret_file."""
    path = os.path.join(_SECRET_DIR, hashlib.sha256(secret).hexdigest()[:16])
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret + b"\n")
    return path

_imms = itertools.count(random.Random().randrange(1 << 20, 1 << 31))


def tcp_rails(addr: NetAddr) -> list[tuple[str, int]]:
    """The (host, port) of each rail of a NetAddr whose rails are tcp (their bytes parsed)."""
    return [parse_rail(r) for r in addr.rails]


def fresh_imm() -> int:
    """An immediate no other test in this session uses."""
    return next(_imms)


def engine_env(rails: Sequence[str], domain: str = "tcp", **engine: Any) -> dict[str, str]:
    """TRANSFERD_ENGINE_* variables for a daemon with these rails and domain."""
    env = {"TRANSFERD_ENGINE_HOST_RAILS": ",".join(rails), "TRANSFERD_ENGINE_DOMAIN": domain}
    for key, value in engine.items():
        env[f"TRANSFERD_ENGINE_{key.upper()}"] = str(value).lower() if isinstance(
            value, bool) else str(value)
    return env


def start_many(specs: Sequence[Mapping[str, Any]]) -> list[DaemonProcess]:
    """Start daemons in parallel (``specs``: keyword arguments of DaemonProcess)."""
    daemons = [DaemonProcess(**spec) for spec in specs]
    try:
        for d in daemons:
            d.start()
        for d in daemons:
            d.wait_ready()
    except BaseException:
        for d in daemons:
            d.stop()
        raise
    return daemons


# A real rpc-server with the host stand-in device (tests/standin_daemon.py): its
# STANDIN_* variables in the env say how its staging is made and how it fails.
STANDIN_COMMAND = [sys.executable, "-m", "tests.standin_daemon", "-H", "127.0.0.1", "-p", "0",
                   "--metrics-port", "-1"]


@contextlib.contextmanager
def standin_pair(a_env: Mapping[str, str], b_env: Mapping[str, str]
                 ) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    """Two stand-in daemons, started in parallel, stopped at the end."""
    ds = start_many([{"command": STANDIN_COMMAND, "env": e} for e in (a_env, b_env)])
    try:
        yield ds[0], ds[1]
    finally:
        for d in ds:
            d.stop()


@dataclass
class Cluster:
    domain: str
    a: DaemonProcess
    b: DaemonProcess
    c: DaemonProcess

    @property
    def daemons(self) -> tuple[DaemonProcess, DaemonProcess, DaemonProcess]:
        return (self.a, self.b, self.c)

    def check_alive(self, when: str) -> None:
        for name, d in zip("abc", self.daemons, strict=True):
            assert d.alive(), f"daemon {name} died {when}\n{d.output()}"

    def output(self) -> str:
        return "\n".join(d.output() for d in self.daemons)


def start_cluster(domain: str, **engine: Any) -> Cluster:
    """Three daemons of ``domain``, each listening on tcp, unix and seqpacket."""
    engine.setdefault("secret_file", secret_file())
    engine.setdefault("handshake_timeout_s", HANDSHAKE_TIMEOUT_S)
    where = tempfile.mkdtemp(prefix="td-cl-", dir="/tmp")  # short: AF_UNIX paths are < 108
    atexit.register(shutil.rmtree, where, True)
    specs = [
        {"env": engine_env(RAILS[n], domain, chaos_seed=i + 1, **engine),
         "args": ["--listen", f"unix://{where}/{n}.sock",
                  "--listen", f"seqpacket://{where}/{n}.seq"]}
        for i, n in enumerate("abc")
    ]
    return Cluster(domain, *start_many(specs))


def _failed(request: pytest.FixtureRequest) -> bool:
    return any(getattr(getattr(request.node, f"rep_{w}", None), "failed", False)
               for w in ("setup", "call"))


# One trio per domain for the whole session.  Each test module takes the fixtures by
# assignment, which gives every module its own fixture definitions: the trios live here,
# not in a fixture's cache, so that all modules share them.
_CLUSTERS: dict[str, Cluster] = {}


@pytest.fixture(scope="session")
def clusters() -> Iterator[Callable[[str], Cluster]]:
    """``clusters(name)``: the session's trio of that name (TRIOS), started on first use."""

    def get(name: str) -> Cluster:
        if name not in _CLUSTERS:
            domain, engine = TRIOS[name]
            _CLUSTERS[name] = start_cluster(domain, **engine)
        return _CLUSTERS[name]

    yield get
    # Session teardown (every module's copy runs it; the first one stops them all).
    while _CLUSTERS:
        _, cl = _CLUSTERS.popitem()
        for d in cl.daemons:
            d.stop()


def _watch(cl: Cluster, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    cl.check_alive("before this test")
    marks = [len(d.stderr) for d in cl.daemons]
    yield cl
    if _failed(request):
        print(cl.output())
    cl.check_alive("during this test")
    # Nothing went wrong inside a daemon without the test noticing.
    for name, d, mark in zip("abc", cl.daemons, marks, strict=True):
        new = d.stderr[mark:]
        assert "Traceback" not in new and " ERROR " not in new, f"daemon {name}:\n{new}"


@pytest.fixture
def own_daemons(request: pytest.FixtureRequest) -> Iterator[list[DaemonProcess]]:
    """Daemons a test starts itself (appended to this list); stopped after it, their
    output printed if it failed, none may have a traceback."""
    started: list[DaemonProcess] = []
    yield started
    failed = _failed(request)
    for d in started:
        d.stop()
        if failed:
            print(d.output())
    for d in started:
        assert "Traceback" not in d.stderr, d.output()


# The client transport :func:`nodes` and :func:`client_url` use: the ``cluster``
# fixture sets it for its test (a global, not a Cluster field, because the trios are
# shared by every transport and ``nodes`` is handed daemons, not a cluster).
_client_transport = "tcp"


def client_url(d: DaemonProcess) -> str:
    """The URL of ``d`` for the client transport in use (tcp outside ``cluster``)."""
    return d.url if _client_transport == "tcp" else d.url_for(_client_transport)


@pytest.fixture(params=CLUSTER_PARAMS, ids=lambda p: p[0] if p[1] == "tcp" else "-".join(p))
def cluster(
    request: pytest.FixtureRequest, clusters: Callable[[str], Cluster]
) -> Iterator[Cluster]:
    """A running trio of two-rail daemons, its clients over one transport (CLUSTER_PARAMS);
    all must survive the test."""
    global _client_transport
    trio, transport = request.param
    _client_transport = transport
    try:
        yield from _watch(clusters(trio), request)
    finally:
        _client_transport = "tcp"


@pytest.fixture
def tcp_cluster(
    clusters: Callable[[str], Cluster], request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """The TCP trio only (tests whose subject is not ordering)."""
    yield from _watch(clusters("tcp"), request)


# -- a client with the bookkeeping a test needs -------------------------------------------------


@dataclass
class Region:
    buf: RemoteBuffer
    mr: MrHandle
    desc: MrDesc
    data: bytearray  # what the test expects the buffer to hold

    @property
    def size(self) -> int:
        return self.buf.size


@dataclass
class Node:
    """One client of one daemon; frees what it allocated when closed."""

    daemon: DaemonProcess
    client: Client
    buffers: list[RemoteBuffer] = field(default_factory=list)

    async def region(self, size: int, seed: int | None = None) -> Region:
        """A registered buffer filled with a known pattern (``seed``) or zeros."""
        buf = await self.client.alloc_buffer(size)
        self.buffers.append(buf)
        data = bytearray(size) if seed is None else bytearray(pattern(size, seed))
        if seed is not None:
            await self.client.set_tensor(buf.tensor(), data)
        mr, desc = await self.client.reg_mr(buf)
        return Region(buf, mr, desc, data)

    async def read(self, r: Region, offset: int = 0, size: int | None = None) -> bytes:
        size = r.size - offset if size is None else size
        return bytes(await self.client.get_tensor(r.buf.tensor(offset, size)))

    async def close(self) -> None:
        """Free what is left and close (errors ignored: the daemon may be gone)."""
        for buf in self.buffers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.client.free_buffer(buf), 5)
        self.buffers.clear()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.client.close(), 5)


# TRANSFERD_TEST_INPROC=1: :func:`nodes` puts an engine in the test's own process
# (``Client.connect("inproc://")``, client/inproc.py) in the place of its first daemon's
# client: the same engine settings (domain, workers, secret), rails of its own.  The engine
# suites run so (tests/integration/test_inproc.py runs them) to show the inproc client
# is a peer like any daemon; tests about the first daemon itself (its metrics, its
# process) do not take part (``inproc_ok``).
INPROC = os.environ.get("TRANSFERD_TEST_INPROC", "") == "1"
INPROC_RAILS = ("127.0.0.40", "127.0.0.41")


def inproc_settings(d: DaemonProcess) -> dict[str, Any]:
    """``d``'s engine settings (its TRANSFERD_ENGINE_* variables) for an inproc engine."""
    out: dict[str, Any] = {}
    for k, v in d.env.items():
        if k.startswith("TRANSFERD_ENGINE_"):
            out["engine." + k.removeprefix("TRANSFERD_ENGINE_").lower()] = v
    out["engine.host_rails"] = ",".join(INPROC_RAILS[: len(out.get("engine.host_rails",
                                                                   "x").split(","))])
    return out


async def connect_node(d: DaemonProcess, first: bool = False) -> Client:
    if INPROC and first:
        return await Client.connect("inproc://", overrides=inproc_settings(d), timeout=WAIT)
    return await Client.connect(client_url(d), timeout=WAIT)


@contextlib.asynccontextmanager
async def nodes(*daemons: DaemonProcess) -> AsyncIterator[list[Node]]:
    """One connected Node per daemon, closed (buffers freed) on the way out."""
    opened: list[Node] = []
    try:
        for i, d in enumerate(daemons):
            opened.append(Node(d, await connect_node(d, first=i == 0)))
        yield opened
    finally:
        for n in opened:
            await n.close()


async def settle(completions: Sequence[Any], timeout: float = WAIT) -> list[BaseException | None]:
    """Wait for every Completion; the error of each (None where it succeeded)."""
    out: list[BaseException | None] = []
    for c in completions:
        try:
            await c.wait(timeout)
            out.append(None)
        except TimeoutError:
            raise AssertionError(f"{c!r} did not complete within {timeout} s") from None
        except Exception as exc:
            out.append(exc)
    return out


async def verified(completions: Sequence[Any], timeout: float = WAIT * 2) -> list[int]:
    """Settle verified transfers over a path that corrupts some pieces: each failed one
    failed with the checksum's error (its re-send was corrupted too), at least half
    succeeded; the indices of those that did."""
    from transferd.protocol.errors import PeerUnreachable

    errors = await settle(completions, timeout)
    for e in errors:
        assert e is None or (isinstance(e, PeerUnreachable)
                             and "checksum mismatch" in str(e)), e
    ok = [i for i, e in enumerate(errors) if e is None]
    assert len(ok) >= len(errors) // 2, errors
    return ok


async def poll(fn: Callable[[], Any], want: Any, timeout: float = WAIT,
               interval: float = 0.01) -> Any:
    """Call async ``fn`` until it returns ``want`` (bounded); its last value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await fn()
        if value == want or loop.time() > deadline:
            return value
        await asyncio.sleep(interval)


# -- processes and sockets --------------------------------------------------------------------


@contextlib.contextmanager
def stopped(d: DaemonProcess) -> Iterator[None]:
    """SIGSTOP a daemon for the block; SIGCONT after (even if the test fails)."""
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        # A stop reaches each thread of the process in turn: until all of them are
        # stopped, a worker thread may still be handling frames.
        assert wait_until(lambda: _all_stopped(d.proc.pid) if d.proc else True, WAIT), \
            "the daemon did not stop"
        yield
    finally:
        if d.proc.poll() is None:
            os.kill(d.proc.pid, signal.SIGCONT)


def _all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T in /proc)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state not in ("T", "t"):
            return False
    return True


def open_connections(d: DaemonProcess) -> float:
    assert d.metrics_url is not None
    return metric(scrape(d.metrics_url), "transferd_open_connections")


async def wait_connections(d: DaemonProcess, n: int, timeout: float = WAIT) -> None:
    """Until the daemon counts ``n`` open client connections (it saw a close)."""
    ok = await asyncio.to_thread(wait_until, lambda: open_connections(d) == n, timeout)
    assert ok, f"{open_connections(d)} connections open, expected {n}"


def _hexaddr(h: str) -> tuple[str, int]:
    ip, port = h.split(":")
    raw = bytes.fromhex(ip)[::-1]
    return ".".join(str(b) for b in raw), int(port, 16)


def tcp_connections() -> set[tuple[tuple[str, int], tuple[str, int]]]:
    """Established IPv4 TCP connections on this host: {(local, remote)}."""
    out = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[3] == "01":  # ESTABLISHED
                out.add((_hexaddr(fields[1]), _hexaddr(fields[2])))
    return out


def links_into(listener: tuple[str, int]) -> list[tuple[str, int]]:
    """The remote ends of established connections accepted on ``listener``."""
    return sorted(remote for local, remote in tcp_connections() if local == listener)


Links = list[list[tuple[str, int]]]


def links_settle(listeners: Sequence[tuple[str, int]], want: Callable[[Links], bool],
                 timeout: float = 5.0) -> Links:
    """``links_into`` of each listener, read until ``want`` holds (bounded): /proc/net/tcp
    is read in pieces, and a busy host's table may move under the reader."""
    seen: Links = []

    def check() -> bool:
        seen[:] = [links_into(x) for x in listeners]
        return want(seen)

    wait_until(check, timeout)
    return seen


def inflight(d: DaemonProcess) -> list[dict[str, Any]]:
    """`transferd inflight URL --json`, the CLI as an operator runs it."""
    r = subprocess.run([sys.executable, "-m", "transferd.cli", "inflight", d.url, "--json"],
                       capture_output=True, text=True, timeout=30, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout)["entries"])
