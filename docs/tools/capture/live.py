"""A daemon and a raw connection: the plumbing every example runs on.

:class:`Zygote` forks daemons, :class:`Daemon` is one ``rpc-server``, :class:`Conn`
is a plain TCP socket that records the frames it sends and receives into a
:class:`Capture`, and :class:`Daemons` are the daemons one example talks to.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any, ClassVar

from capture import ENTRY, REPO
from transferd.protocol import (
    HEADER,
    HEADER_SIZE,
    PROTO_MAJOR,
    PROTO_MINOR,
    Command,
    encode_frame,
)

CLIENT_NAME = "capture_frames/1"
TOKEN = "s3cret"


def _token_config() -> str:
    """A config for the "token" daemon: the secret from a file, the token method on tcp too
    (these examples use TCP; by default only local sockets and TLS offer it)."""
    d = tempfile.mkdtemp(prefix="td-capture-")
    secret = os.path.join(d, "token")
    with open(secret, "w") as f:
        f.write(TOKEN + "\n")
    os.chmod(secret, 0o600)  # the daemon refuses a secret others can read
    cfg = os.path.join(d, "token.toml")
    with open(cfg, "w") as f:
        f.write(f'[server]\ntoken_file = "{secret}"\n'
                'token_transports = ["tcp", "unix", "seqpacket", "tls"]\n')
    return cfg


def _names_config() -> str:
    """A config for the "names" daemon: a node name that is the same on every machine."""
    d = tempfile.mkdtemp(prefix="td-capture-")
    cfg = os.path.join(d, "names.toml")
    with open(cfg, "w") as f:
        f.write('[discovery]\nnode_name = "node-a"\n')
    return cfg


HELLO_BODY = {"major": PROTO_MAJOR, "minor": PROTO_MINOR, "client": CLIENT_NAME}


def _daemon_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}


class Zygote:
    """A Python with the daemon's modules imported, forking one daemon per request.

    Starting ``rpc-server`` is mostly imports (about 0.4 s of CPU), and the
    examples need some fifty fresh daemons; forked from here each one starts
    in a few milliseconds.  A forked daemon runs ``rpc_server.cli.main`` with
    the same arguments a fresh process would get.  Its stdout and stderr are
    the Unix socket the request came on; it stops (SIGTERM, as a service
    does) when the other end shuts that socket down, so no daemon outlives
    this script, and the zygote itself exits when its stdin closes.
    """

    def __init__(self) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="capture-frames-")
        self.path = os.path.join(self.dir.name, "zygote.sock")
        self.proc = subprocess.Popen(
            [sys.executable, str(ENTRY), "--zygote", self.path],
            cwd=REPO, env=_daemon_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "zygote ready":
            self.close()
            raise RuntimeError(f"the zygote did not start: {line}{self.proc.stdout.read()}")

    def spawn(self, argv: Sequence[str]) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(self.path)
        s.sendall(json.dumps(list(argv)).encode() + b"\n")
        return s

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the zygote's signal to exit
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.dir.cleanup()

    @staticmethod
    def serve(path: str) -> None:
        """The zygote's side (``capture_frames.py --zygote PATH``)."""
        import selectors
        import signal
        import threading
        import traceback

        import uvloop  # noqa: F401

        # What a daemon imports as it starts, imported once here instead.
        import rpc_server.cli
        import rpc_server.server
        import transferd.engine.engine  # noqa: F401

        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the daemons
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(64)
        sel = selectors.DefaultSelector()
        sel.register(srv, selectors.EVENT_READ)
        sel.register(sys.stdin, selectors.EVENT_READ)
        print("zygote ready", flush=True)
        while True:
            ready = [key.fileobj for key, _ in sel.select()]
            if sys.stdin in ready and not sys.stdin.readline():
                return  # the script is gone
            if srv not in ready:
                continue
            conn, _ = srv.accept()
            argv = json.loads(conn.makefile("rb").readline())
            sys.stdout.flush()
            if os.fork():
                conn.close()
                continue
            code = 1
            try:
                srv.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.dup2(conn.fileno(), 1)
                os.dup2(conn.fileno(), 2)

                def watch(link: socket.socket) -> None:
                    # The script shut its end: stop as if systemd said so.
                    while link.recv(1):
                        pass
                    os.kill(os.getpid(), signal.SIGTERM)

                threading.Thread(target=watch, args=(conn,), daemon=True).start()
                rpc_server.cli.main(argv, prog_name="rpc-server")
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)


class Daemon:
    """``rpc-server`` on a port of the system's choosing: forked by the zygote
    when there is one, else started as a child process."""

    zygote: ClassVar[Zygote | None] = None

    def __init__(self, *args: str, host: str = "127.0.0.1", wait: bool = True) -> None:
        argv = ["-H", host, "-p", "0", "--metrics-port", "-1", "--log-level", "error", *args]
        self.host = host
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None
        self.sock: socket.socket | None = None
        if self.zygote is not None:
            self.sock = self.zygote.spawn(argv)
            self.out: IO[str] = self.sock.makefile("r")
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rpc_server.cli", *argv], cwd=REPO, env=_daemon_env(),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            assert self.proc.stdout is not None
            self.out = self.proc.stdout
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        lines = []
        while time.monotonic() < deadline:
            line = self.out.readline()
            if not line:
                break
            lines.append(line)
            m = re.match(r"transferd: listening on tcp://[^:]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
            if line.startswith("transferd: ready"):
                return
        self.close()
        raise RuntimeError("daemon did not start:\n" + "".join(lines))

    def close(self) -> None:
        if self.sock is not None:
            # The daemon stops when it sees this; wait until it has exited.
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)
                self.sock.settimeout(10)
                while self.sock.recv(4096):
                    pass
            self.out.close()
            self.sock.close()
            self.sock = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Wire:
    """One frame as it crossed the wire."""

    sent: bool  # True: client -> server
    raw: bytes
    # Who the two ends are, as the example shows them ("client -> daemon B").
    server: str = "server"
    me: str = "client"


@dataclass
class Capture:
    title: str
    wire: list[Wire] = field(default_factory=list)
    closed: bool = False  # the server closed the connection after the last frame
    note: str = ""


class Conn:
    def __init__(
        self,
        port: int,
        capture: Capture | None = None,
        host: str = "127.0.0.1",
        server: str = "server",
        me: str = "client",
    ) -> None:
        self.sock = socket.create_connection((host, port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.capture = capture
        self.server = server
        self.me = me

    def send(
        self,
        cmd: int,
        seq: int,
        body: dict[str, Any] | None = None,
        payload: bytes = b"",
        flags: int = 0,
        raw: bytes | None = None,
    ) -> None:
        if raw is None:
            raw = encode_frame(cmd, flags, seq, body, len(payload)) + payload
        self.sock.sendall(raw)
        if self.capture is not None:
            self.capture.wire.append(Wire(True, raw, self.server, self.me))

    def _read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise EOFError
            out += chunk
        return bytes(out)

    def recv(self) -> bytes:
        head = self._read(HEADER_SIZE)
        _, _, _, _, body_len, _, payload_len = HEADER.unpack(head)
        raw = head + self._read(body_len + payload_len)
        if self.capture is not None:
            self.capture.wire.append(Wire(False, raw, self.server, self.me))
        return raw

    def recv_data(self) -> bytes:
        """One frame of the peer plane's data phase (its size from its fixed header)."""
        from transferd.protocol.peer_wire import frame_size

        raw = self._read(1)
        while (n := frame_size(raw)) is None:
            raw += self._read(1)
        raw += self._read(n - len(raw))
        if self.capture is not None:
            self.capture.wire.append(Wire(False, raw, self.server, self.me))
        return raw

    def expect_close(self) -> None:
        self.sock.settimeout(5)
        if self.sock.recv(1) != b"":
            raise AssertionError("expected the server to close the connection")
        if self.capture is not None:
            self.capture.closed = True

    def expect_silence(self, seconds: float = 0.3) -> None:
        """Nothing comes back (a NO_REPLY request that succeeded)."""
        self.sock.settimeout(seconds)
        with contextlib.suppress(TimeoutError):
            data = self.sock.recv(1)
            raise AssertionError(f"expected no reply, got {data!r}")
        self.sock.settimeout(10)

    def hello(self, seq: int = 1, **extra: Any) -> bytes:
        self.send(Command.HELLO, seq, {**HELLO_BODY, **extra})
        return self.recv()

    def close(self) -> None:
        self.sock.close()


class Daemons:
    """The daemons one example talks to, each started fresh on first use.

    ``main`` is a default ``rpc-server``; ``minor1`` runs with ``--protocol-minor
    1``; ``token`` requires the secret ``s3cret`` (from a token file); ``b`` is a default one on
    127.0.0.2, the engine examples' second node (``main`` is their node A).  A
    fresh daemon per example keeps buffer ids and counters the same whichever
    examples are run.
    """

    ARGS: ClassVar[dict[str, tuple[str, ...]]] = {
        "main": (),
        "minor1": ("--protocol-minor", "1"),
        "token": ("-c", _token_config()),
        "b": (),
        "names": ("-c", _names_config()),
    }
    HOSTS: ClassVar[dict[str, str]] = {"b": "127.0.0.2"}

    def __init__(self) -> None:
        self._running: dict[str, Daemon] = {}

    def start(self, *kinds: str) -> None:
        """Start several daemons side by side (each takes a moment to import)."""
        new = [k for k in kinds if k not in self._running]
        for k in new:
            self._running[k] = Daemon(
                *self.ARGS[k], host=self.HOSTS.get(k, "127.0.0.1"), wait=False
            )
        for k in new:
            self._running[k].wait_ready()

    def __getitem__(self, kind: str) -> Daemon:
        self.start(kind)
        return self._running[kind]

    def close(self) -> None:
        for d in self._running.values():
            d.close()
        self._running.clear()
