"""Shared test helpers: a real daemon as a subprocess, coroutines under a timeout, raw frames.

Nothing here mocks the daemon: :class:`DaemonProcess` starts ``rpc_server.cli``
(or any command given) as a child process, waits for the lines it prints on
stdout, and tears it down (SIGTERM, then SIGKILL) when done.  Several may run
at once; each gets its own ports (``-p 0 --metrics-port 0``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import inspect
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from transferd.protocol.constants import HEADER_SIZE, PROTO_MAJOR, Command, Flag
from transferd.protocol.frames import Frame, FrameDecoder, encode_frame

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent

# Startup of a daemon on this (2-core) machine takes well under a second;
# a loaded CI box gets generous slack.
READY_TIMEOUT = 30.0

_LISTEN = re.compile(r"^transferd: listening on (\S+)")
_METRICS = re.compile(r"^transferd: metrics on (\S+)")
_READY = "transferd: ready"


class DaemonError(RuntimeError):
    """The daemon did not come up (or misbehaved); the message carries its output."""


class DaemonProcess:
    """One daemon as a child process.

    ``DaemonProcess(["--protocol-minor", "1"]).start()`` runs
    ``python -m rpc_server.cli -H 127.0.0.1 -p 0 --metrics-port 0 --protocol-minor 1``.
    Pass ``command`` to run something else (``[sys.executable, "-m",
    "transferd.cli", "serve", ...]``) with no default flags added.  ``env``
    entries are added to (``None`` values removed from) a copy of os.environ.
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
        *,
        command: Sequence[str] | None = None,
        host: str = "127.0.0.1",
        metrics: bool = True,
        ready_timeout: float = READY_TIMEOUT,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        if command is None:
            command = [sys.executable, "-m", "rpc_server.cli", "-H", host, "-p", "0"]
            command += ["--metrics-port", "0" if metrics else "-1"]
        self.argv = [*command, *args]
        self.env = dict(os.environ)
        # A test's own TRANSFERD_* settings must not leak into the daemon.
        for k in list(self.env):
            if k.startswith("TRANSFERD_"):
                del self.env[k]
        for k, v in (env or {}).items():
            if v is None:
                self.env.pop(k, None)
            else:
                self.env[k] = v
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.ready_timeout = ready_timeout
        self.cwd = str(cwd) if cwd is not None else str(REPO)
        self.proc: subprocess.Popen[str] | None = None
        self.urls: list[str] = []
        self.metrics_url: str | None = None
        self.stdout_lines: list[str] = []
        # A file, not a pipe: a chatty daemon can never block on a full pipe.
        self._stderr = tempfile.TemporaryFile(  # noqa: SIM115 - read after stop(), so it lives with self
            mode="w+", encoding="utf-8", errors="replace"
        )
        self._ready = threading.Event()
        self._eof = threading.Event()
        self._reader: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> DaemonProcess:
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.cwd,
            text=True,
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> DaemonProcess:
        """Block until ``transferd: ready``; raise DaemonError with its output if not."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + (timeout if timeout is not None else self.ready_timeout)
        while not self._ready.is_set():
            if self._eof.is_set() or self.proc.poll() is not None:
                self._eof.wait(2)
                rc = self.proc.wait(5)
                raise DaemonError(f"daemon exited with {rc} before ready\n{self.output()}")
            if time.monotonic() > deadline:
                self.stop()
                raise DaemonError(f"daemon not ready in time\n{self.output()}")
            self._ready.wait(0.05)
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self._reader is not None:
            self._reader.join(5)
        if p.stdout is not None:
            p.stdout.close()
        return p.returncode

    def kill(self) -> None:
        """SIGKILL now (a crashed daemon)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def __enter__(self) -> DaemonProcess:
        if self.proc is None:
            self.start()
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what it printed -------------------------------------------------------------

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                line = line.rstrip("\n")
                self.stdout_lines.append(line)
                if m := _LISTEN.match(line):
                    self.urls.append(m.group(1))
                elif m := _METRICS.match(line):
                    self.metrics_url = m.group(1)
                elif line.strip() == _READY:
                    self._ready.set()
        except (OSError, ValueError):
            pass
        finally:
            self._eof.set()

    @property
    def stderr(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()

    def output(self) -> str:
        return (
            f"argv: {self.argv}\n--- stdout ---\n"
            + "\n".join(self.stdout_lines)
            + f"\n--- stderr ---\n{self.stderr}"
        )

    @property
    def url(self) -> str:
        """The first TCP URL it listens on."""
        for u in self.urls:
            if u.startswith("tcp://"):
                return u
        raise DaemonError(f"no tcp listener\n{self.output()}")

    def url_for(self, scheme: str) -> str:
        """The first URL it listens on with this scheme (tcp, tls, unix, seqpacket)."""
        for u in self.urls:
            if u.startswith(scheme + "://"):
                return u
        raise DaemonError(f"no {scheme} listener\n{self.output()}")

    @property
    def unix_url(self) -> str | None:
        for u in self.urls:
            if u.startswith("unix://"):
                return u
        return None

    @property
    def unix_path(self) -> str | None:
        u = self.unix_url
        return u[len("unix://") :] if u else None

    @property
    def host_port(self) -> tuple[str, int]:
        rest = self.url[len("tcp://") :]
        host, _, port = rest.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def start_daemon(args: Sequence[str] = (), env: Mapping[str, str | None] | None = None,
                 **kw: Any) -> DaemonProcess:
    """Start a daemon and wait until it is ready (the caller stops it)."""
    d = DaemonProcess(args, env, **kw).start()
    try:
        return d.wait_ready()
    except BaseException:
        d.stop()
        raise


# -- coroutines under a timeout ---------------------------------------------------------


def _loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    if kind == "asyncio":
        return None
    raise ValueError(f"unknown loop kind {kind!r}")


def run(
    coro: Coroutine[Any, Any, T] | Awaitable[T], timeout: float = 30.0, loop: str = "uvloop"
) -> T:
    """Run ``coro`` to completion on a fresh loop (uvloop by default) within ``timeout`` s."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    with asyncio.Runner(loop_factory=_loop_factory(loop)) as runner:
        return runner.run(bounded())


def async_test(
    timeout: float = 30.0, loop: str = "uvloop"
) -> Callable[[Callable[..., Coroutine[Any, Any, None]]], Callable[..., None]]:
    """Decorate an ``async def test_...`` so pytest runs it via :func:`run`."""

    def wrap(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
        assert inspect.iscoroutinefunction(fn), fn

        @functools.wraps(fn)
        def sync(*args: Any, **kwargs: Any) -> None:
            run(fn(*args, **kwargs), timeout=timeout, loop=loop)

        return sync

    return wrap


# -- data and checksums ---------------------------------------------------------------


def pattern(size: int, seed: int = 0) -> bytes:
    """Deterministic pseudo-random bytes (a shifted or misplaced block is detected)."""
    return random.Random(seed * 7919 + size).randbytes(size)


def digest(data: Any) -> str:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


# -- raw frames over a plain socket ------------------------------------------------------


class RawConn:
    """A blocking socket that speaks frames by hand (for malformed-input tests)."""

    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.decoder = FrameDecoder()
        self.frames: list[Frame] = []
        self.seq = 0

    @classmethod
    def to(cls, daemon: DaemonProcess, timeout: float = 10.0) -> RawConn:
        return cls(*daemon.host_port, timeout=timeout)

    @classmethod
    def at(cls, url: str, timeout: float = 10.0, cafile: str | None = None) -> RawConn:
        """A raw connection to a tcp://, unix://, seqpacket:// (a frame a message: each
        is sent in one call) or tls:// URL (``cafile``: the server's certificate)."""
        scheme, _, where = url.partition("://")
        if scheme == "tcp":
            host, _, port = where.rpartition(":")
            return cls(host.strip("[]"), int(port), timeout=timeout)
        self = cls.__new__(cls)
        self.decoder, self.frames, self.seq = FrameDecoder(), [], 0
        if scheme == "tls":
            import ssl

            ctx = ssl.create_default_context(cafile=cafile)
            host, _, port = where.rpartition(":")
            self.sock = ctx.wrap_socket(
                socket.create_connection((host, int(port)), timeout=timeout),
                server_hostname=host)
            return self
        kind = socket.SOCK_SEQPACKET if scheme == "seqpacket" else socket.SOCK_STREAM
        self.sock = socket.socket(socket.AF_UNIX, kind)
        self.sock.settimeout(timeout)
        self.sock.connect(where)
        return self

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(
        self,
        cmd: int,
        body: dict[str, Any] | None = None,
        payload: bytes = b"",
        flags: int = 0,
        seq: int | None = None,
    ) -> int:
        if seq is None:
            self.seq += 1
            seq = self.seq
        self.sock.sendall(encode_frame(cmd, flags, seq, body, len(payload)) + payload)
        return seq

    def hello(self, minor: int = 2, token: str | None = None) -> Frame:
        body: dict[str, Any] = {"major": PROTO_MAJOR, "minor": minor, "client": "raw-test"}
        if token is not None:
            body["token"] = token
        self.send(Command.HELLO, body)
        return self.recv()

    def recv(self) -> Frame:
        """The next frame; raises ConnectionError on EOF, TimeoutError on silence."""
        while not self.frames:
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("peer closed the connection")
            self.frames += self.decoder.feed(data)
        return self.frames.pop(0)

    def request(self, cmd: int, body: dict[str, Any] | None = None, payload: bytes = b"") -> Frame:
        seq = self.send(cmd, body, payload)
        f = self.recv()
        assert f.seq == seq, (f, seq)
        return f

    def closed_by_peer(self, timeout: float = 5.0) -> bool:
        """True once the peer has closed (EOF or reset) within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    return True
                self.frames += self.decoder.feed(data)
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


HEADER_LEN = HEADER_SIZE
REPLY_ERROR = Flag.REPLY | Flag.ERROR


# -- metrics ----------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


# What a lying server does with each frame after HELLO: write to the writer (or nothing).
Lie = Callable[[Frame, asyncio.StreamWriter], None]


@contextlib.asynccontextmanager
async def lying_server(lie: Lie, max_payload: int = 1 << 30,
                       hello: Callable[[asyncio.StreamWriter], None] | None = None,
                       hello_body: dict[str, Any] | None = None) -> Any:
    """A server that answers HELLO as a minor-2 server (``max_payload`` announced, or
    ``hello_body`` as it is; then ``hello``) and every other frame with ``lie``: for a
    real Client held to the protocol by a peer that is not.  Yields its ``tcp://`` URL."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = FrameDecoder()
        while data := await reader.read(65536):
            for f in dec.feed(data):
                if f.cmd == int(Command.HELLO):
                    writer.write(encode_frame(f.cmd, int(Flag.REPLY), f.seq, hello_body or {
                        "major": 1, "minor": 2, "patch": 0, "server": "liar", "features": [],
                        "max_body": 1 << 22, "max_payload": max_payload}))
                    if hello is not None:
                        hello(writer)
                else:
                    lie(f, writer)
                await writer.drain()
        writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"tcp://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    finally:
        srv.close()


Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.contextmanager
def served_on_thread(serve: Serve) -> Any:
    """An asyncio server on loopback calling ``serve`` per connection, on a loop and
    thread of its own: for a command line (a subprocess, or a blocking call) held to a
    server that is not a daemon.  Yields its ``tcp://`` URL; the loop stops at the end."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    url: list[str] = []

    async def start() -> None:
        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        url.append(f"tcp://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
        ready.set()

    t = threading.Thread(target=lambda: (loop.run_until_complete(start()),
                                         loop.run_forever()), daemon=True)
    t.start()
    assert ready.wait(10), "the server on its thread did not start"
    try:
        yield url[0]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Fetch a Prometheus text page; keys are ``name{labels}`` exactly as printed."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric(samples: Mapping[str, float], name: str, **labels: str) -> float:
    """One sample by name and labels (label order does not matter); 0.0 when absent."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = set(rest.rstrip("}").split(",")) if rest else set()
        have.discard("")
        if have == want:
            return value
    return 0.0


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll ``pred`` until it holds or ``timeout`` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def rss(d: DaemonProcess) -> int:
    """The daemon's resident memory in bytes (VmRSS of /proc/PID/status)."""
    assert d.proc is not None
    with open(f"/proc/{d.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")
