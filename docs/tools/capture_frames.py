#!/usr/bin/env python3
"""Regenerate the example frames in docs/protocol.md from a live daemon.

Every example is real traffic: requests are built with
``transferd.protocol.encode_frame`` and sent over a plain TCP socket to a
daemon this script starts (``rpc_server.cli -p 0``, forked from an
interpreter that has imported it once: see :class:`Zygote`), and replies are
the exact bytes the daemon sent back.  Nothing is typed by hand.

    python docs/tools/capture_frames.py            # print every example
    python docs/tools/capture_frames.py --write    # rewrite the blocks in docs/protocol.md
    python docs/tools/capture_frames.py --check    # exit 1 if docs/protocol.md is stale

In docs/protocol.md each example lives between ``<!-- capture:NAME -->`` and
``<!-- /capture -->``; ``--write`` replaces what is between the markers.

The transfer-engine examples talk to two daemons (A on 127.0.0.1, B on
127.0.0.2) and carry values that differ on every run: node ids, rkeys, ports
and addresses.  For those (``@example(..., volatile=True)``) ``--check``
parses the frames back out of the document, checks that each block is
consistent with its own bytes, and compares it with a fresh capture after
renaming every such value to a placeholder in order of first appearance (so
"the rkey REG_MR returned is the one SINGLE_WRITE used" is still checked);
``--write`` leaves such a block alone unless it differs beyond those values.
Examples are captured in parallel (``-j``), each with daemons of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import msgpack  # noqa: E402

from transferd.protocol import (  # noqa: E402
    HEADER,
    HEADER_SIZE,
    PROTO_MAJOR,
    PROTO_MINOR,
    Command,
    Flag,
    FrameDecoder,
    command_name,
    encode_frame,
)
from transferd.protocol.peer import PeerCommand  # noqa: E402

DOC = REPO / "docs" / "protocol.md"
CLIENT_NAME = "capture_frames/1"
TOKEN = "s3cret"
HELLO_BODY = {"major": PROTO_MAJOR, "minor": PROTO_MINOR, "client": CLIENT_NAME}
PEER_COMMANDS = {int(c) for c in PeerCommand}


# -- a daemon and a raw connection ---------------------------------------------------


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
            [sys.executable, __file__, "--zygote", self.path],
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


# -- the examples -----------------------------------------------------------------------


class Daemons:
    """The daemons one example talks to, each started fresh on first use.

    ``main`` is a default ``rpc-server``; ``minor1`` runs with ``--protocol-minor
    1``; ``token`` requires ``--token s3cret``; ``b`` is a default one on
    127.0.0.2, the engine examples' second node (``main`` is their node A).  A
    fresh daemon per example keeps buffer ids and counters the same whichever
    examples are run.
    """

    ARGS: ClassVar[dict[str, tuple[str, ...]]] = {
        "main": (),
        "minor1": ("--protocol-minor", "1"),
        "token": ("--token", TOKEN),
        "b": (),
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


Example = Callable[[Daemons], Capture]
EXAMPLES: dict[str, Example] = {}
# Examples whose frames hold values that differ per run (see the module doc).
VOLATILE: set[str] = set()


def example(name: str, *, volatile: bool = False) -> Callable[[Example], Example]:
    def register(fn: Example) -> Example:
        EXAMPLES[name] = fn
        if volatile:
            VOLATILE.add(name)
        return fn

    return register


@contextlib.contextmanager
def session(
    d: Daemon,
    title: str,
    *,
    hello: bool = True,
    token: str | None = None,
    server: str = "server",
    capture: Capture | None = None,
) -> Iterator[tuple[Conn, Capture]]:
    """A fresh connection, HELLO done off the record unless ``hello`` is False.

    ``server`` names the daemon in the rendering; ``capture`` records this
    connection's frames into an existing capture (two daemons in one example).
    """
    cap = capture if capture is not None else Capture(title)
    c = Conn(d.port, host=d.host, server=server)
    try:
        if hello:
            if token:
                c.hello(token=token)
            else:
                c.hello()
        c.capture = cap
        yield c, cap
    finally:
        c.close()


@contextlib.contextmanager
def off_record(c: Conn) -> Iterator[Conn]:
    """``c`` with its frames kept out of the capture for the duration."""
    cap, c.capture = c.capture, None
    try:
        yield c
    finally:
        c.capture = cap


def _with_buffer(c: Conn, size: int = 64) -> int:
    """Allocate a buffer off the record; returns its id."""
    with off_record(c):
        c.send(Command.ALLOC_BUFFER, 90, {"device": "cpu", "size": size})
        body = msgpack.unpackb(_body_of(c.recv()))
    return int(body["buffer"])


def _quiet(c: Conn, cmd: int, seq: int, body: dict[str, Any], payload: bytes = b"") -> None:
    with off_record(c):
        c.send(cmd, seq, body, payload)
        c.recv()


def _body_of(raw: bytes) -> bytes:
    _, _, _, _, body_len, _, _ = HEADER.unpack_from(raw)
    return raw[HEADER_SIZE : HEADER_SIZE + body_len]


def request_example(
    name: str,
    title: str,
    cmd: int,
    body: dict[str, Any] | Callable[[int], dict[str, Any]] | None = None,
    payload: bytes = b"",
    *,
    daemon: str = "main",
    flags: int = 0,
    reply: bool = True,
    note: str = "",
    volatile: bool = False,
) -> None:
    """Register an example that is one request (after HELLO) and its reply.

    A ``body`` that is a function of a buffer id makes the example allocate a
    64-byte buffer off the record first; the request is then seq 3, else 2.
    ``reply=False``: the request is NO_REPLY and nothing comes back.
    """

    def run(ds: Daemons) -> Capture:
        with session(ds[daemon], title) as (c, cap):
            if callable(body):
                c.send(cmd, 3, body(_with_buffer(c)), payload, flags)
            else:
                c.send(cmd, 2, body, payload, flags)
            if reply:
                c.recv()
            else:
                c.expect_silence()
        cap.note = note
        return cap

    example(name, volatile=volatile)(run)


def hello_example(name: str, title: str, *, daemon: str = "main", **extra: Any) -> None:
    """Register an example that is a HELLO (with ``extra`` in its body) and its reply."""

    def run(ds: Daemons) -> Capture:
        with session(ds[daemon], title, hello=False) as (c, cap):
            c.hello(**extra)
        return cap

    example(name)(run)


def closing_example(
    name: str, title: str, frame: bytes, *, daemon: str = "main", hello: bool = True
) -> None:
    """Register an example that is a frame the server answers with an error, then closes.

    ``frame`` is sent as the first frame on the connection unless ``hello``.
    """

    def run(ds: Daemons) -> Capture:
        with session(ds[daemon], title, hello=hello) as (c, cap):
            c.send(0, 0, raw=frame)
            c.recv()
            c.expect_close()
        return cap

    example(name)(run)


hello_example("HELLO", "HELLO to a minor-2 server")
hello_example("HELLO_MINOR1", "HELLO to `rpc-server --protocol-minor 1`", daemon="minor1")
hello_example(
    "HELLO_TOKEN", f"HELLO with a token (`rpc-server --token {TOKEN}`)", daemon="token", token=TOKEN
)
request_example(
    "GET_DEVICES", "GET_DEVICES (empty body both ways but for the list)", Command.GET_DEVICES
)
request_example(
    "ALLOC_BUFFER",
    "ALLOC_BUFFER of 64 bytes on cpu",
    Command.ALLOC_BUFFER,
    {"device": "cpu", "size": 64},
)
request_example("FREE_BUFFER", "FREE_BUFFER", Command.FREE_BUFFER, lambda b: {"buffer": b})
request_example(
    "BUFFER_CLEAR",
    "BUFFER_CLEAR to 0xAB",
    Command.BUFFER_CLEAR,
    lambda b: {"buffer": b, "value": 0xAB},
)
request_example(
    "SET_TENSOR",
    "SET_TENSOR of 8 bytes at offset 0, with a reply",
    Command.SET_TENSOR,
    lambda b: {"tensor": [b, 0, 8]},
    b"01234567",
)
request_example(
    "SET_TENSOR_NO_REPLY",
    "SET_TENSOR with NO_REPLY: nothing comes back",
    Command.SET_TENSOR,
    lambda b: {"tensor": [b, 0, 4]},
    b"abcd",
    flags=Flag.NO_REPLY,
    reply=False,
    note="No frame comes back.",
)


@example("GET_TENSOR")
def ex_get(ds: Daemons) -> Capture:
    with session(ds["main"], "GET_TENSOR of 8 bytes") as (c, cap):
        b = _with_buffer(c)
        _quiet(c, Command.SET_TENSOR, 3, {"tensor": [b, 0, 8]}, b"01234567")
        c.send(Command.GET_TENSOR, 4, {"tensor": [b, 0, 8]})
        c.recv()
    return cap


request_example(
    "COPY_TENSOR",
    "COPY_TENSOR of 8 bytes within one buffer",
    Command.COPY_TENSOR,
    lambda b: {"src": [b, 0, 8], "dst": [b, 8, 8]},
)
request_example("SYNCHRONIZE", "SYNCHRONIZE", Command.SYNCHRONIZE)
request_example("STATS", "STATS on a fresh daemon that has seen one HELLO", Command.STATS)
request_example(
    "SET_TENSORS",
    "SET_TENSORS of two 4-byte tensors, NO_REPLY (as the client's flush sends it)",
    Command.SET_TENSORS,
    lambda b: {"tensors": [[b, 0, 4], [b, 16, 4]]},
    b"AAAABBBB",
    flags=Flag.NO_REPLY,
    reply=False,
    note="No frame comes back; without NO_REPLY the reply is an empty REPLY frame.",
)


@example("GET_TENSORS")
def ex_gets(ds: Daemons) -> Capture:
    with session(ds["main"], "GET_TENSORS of two 4-byte tensors") as (c, cap):
        b = _with_buffer(c)
        _quiet(c, Command.SET_TENSORS, 3, {"tensors": [[b, 0, 4], [b, 16, 4]]}, b"AAAABBBB")
        c.send(Command.GET_TENSORS, 4, {"tensors": [[b, 16, 4], [b, 0, 4]]})
        c.recv()
    return cap


# -- errors -------------------------------------------------------------------------------

request_example(
    "ERR_OUT_OF_BOUNDS",
    "GET_TENSOR past the end of a 64-byte buffer: OUT_OF_BOUNDS",
    Command.GET_TENSOR,
    lambda b: {"tensor": [b, 60, 8]},
)
request_example(
    "ERR_NOT_FOUND",
    "FREE_BUFFER of a buffer that does not exist: NOT_FOUND",
    Command.FREE_BUFFER,
    {"buffer": 999},
)
request_example(
    "ERR_BAD_REQUEST",
    "ALLOC_BUFFER without its size: BAD_REQUEST",
    Command.ALLOC_BUFFER,
    {"device": "cpu"},
)
request_example(
    "ERR_OUT_OF_MEMORY",
    "ALLOC_BUFFER of 1 TiB: OUT_OF_MEMORY",
    Command.ALLOC_BUFFER,
    {"device": "cpu", "size": 1 << 40},
)


@example("ERR_NO_REPLY_EVENT")
def ex_event(ds: Daemons) -> Capture:
    with session(
        ds["main"], "A NO_REPLY SET_TENSOR that fails: an EVENT|ERROR frame with its seq"
    ) as (c, cap):
        b = _with_buffer(c)
        c.send(Command.SET_TENSOR, 3, {"tensor": [b, 62, 4]}, b"abcd", flags=Flag.NO_REPLY)
        c.recv()
        # The connection is still open and serving.
        c.send(Command.SYNCHRONIZE, 4)
        c.recv()
    cap.note = "The connection stays open: the SYNCHRONIZE after it is answered as usual."
    return cap


request_example(
    "ERR_UNKNOWN_COMMAND",
    "GET_TENSORS to a `--protocol-minor 1` server: UNKNOWN_COMMAND",
    Command.GET_TENSORS,
    {"tensors": [[1, 0, 4]]},
    daemon="minor1",
    note="The connection stays open.",
)
closing_example(
    "ERR_NO_HELLO",
    "GET_DEVICES as the first frame: NO_HELLO, then close",
    encode_frame(Command.GET_DEVICES, 0, 1),
    hello=False,
)
closing_example(
    "ERR_VERSION_MISMATCH",
    "HELLO with major 2: VERSION_MISMATCH, then close",
    encode_frame(Command.HELLO, 0, 1, {"major": 2, "minor": 0, "client": CLIENT_NAME}),
    hello=False,
)
closing_example(
    "ERR_UNAUTHORIZED",
    "HELLO without the token the server requires: UNAUTHORIZED",
    encode_frame(Command.HELLO, 0, 1, HELLO_BODY),
    daemon="token",
    hello=False,
)
closing_example(
    "ERR_BAD_FRAME",
    "A header with a bad magic: BAD_FRAME, then close",
    b"XX" + encode_frame(Command.SYNCHRONIZE, 0, 2)[2:],
)
closing_example(
    "ERR_TOO_LARGE",
    "A header announcing a 1 TiB payload: TOO_LARGE, then close",
    encode_frame(Command.SET_TENSOR, 0, 2, None, 1 << 40),
)


# -- the transfer engine: two daemons, A (127.0.0.1) and B (127.0.0.2) ------------------

A_NAME, B_NAME = "daemon A", "daemon B"


def _ask(c: Conn, cmd: int, seq: int, body: dict[str, Any] | None = None,
         payload: bytes = b"", flags: int = 0) -> dict[str, Any]:
    """A request off the record; the body of the frame that answers it."""
    with off_record(c):
        c.send(cmd, seq, body, payload, flags)
        raw = c.recv()
    _, _, rflags, _, _, _, _ = HEADER.unpack_from(raw)
    body_out = msgpack.unpackb(_body_of(raw), raw=False) if _body_of(raw) else {}
    if rflags & Flag.ERROR:
        raise AssertionError(f"{command_name(cmd)} failed off the record: {body_out}")
    return dict(body_out)


def _region(c: Conn, data: bytes = b"", size: int = 64) -> tuple[int, list[Any]]:
    """A buffer registered off the record (filled with ``data``): (mr, desc)."""
    buf = _with_buffer(c, size)
    if data:
        _ask(c, Command.SET_TENSOR, 91, {"tensor": [buf, 0, len(data)]}, data)
    r = _ask(c, Command.REG_MR, 92, {"buffer": buf})
    return int(r["mr"]), r["desc"]


def _address(c: Conn) -> bytes:
    return bytes(_ask(c, Command.MAIN_ADDRESS, 93)["addr"])


@contextlib.contextmanager
def nodes(ds: Daemons, title: str) -> Iterator[tuple[Conn, Conn, Capture]]:
    """Connections to daemons A and B (started side by side), off the record.

    Set ``conn.capture = cap`` to put a connection's frames on the record.
    """
    ds.start("main", "b")
    cap = Capture(title)
    with session(ds["main"], title, server=A_NAME) as (a, _), session(
        ds["b"], title, server=B_NAME
    ) as (b, _):
        a.capture = b.capture = None
        yield a, b, cap


DATA = b"0123456789abcdef"


def _a_to_b(a: Conn, b: Conn) -> tuple[int, list[Any]]:
    """A region on A holding ``DATA`` and an empty one on B: (A's mr, B's desc)."""
    mr, _ = _region(a, DATA)
    _, desc = _region(b)
    return mr, desc


def _two_pages(mr: int, desc: list[Any]) -> dict[str, Any]:
    """PAGED_WRITES' body: A's pages 0 and 2 (4 bytes, stride 4) to B's 1 and 3 (stride 8),
    immediate 8."""
    return {"page_len": 4, "imm": 8, "src": [mr, [[0, 2], 4, 0]], "dst": [desc, [[1, 3], 8, 0]]}


request_example(
    "ENGINE_MAIN_ADDRESS",
    "MAIN_ADDRESS",
    Command.MAIN_ADDRESS,
    volatile=True,
    note="`addr` is the msgpack array `[1, node, group, [[host, port], ...]]`: format 1, the "
    "daemon's random 64-bit node id, domain group 0 (host memory), and its one rail.",
)
request_example(
    "ENGINE_REG_MR",
    "REG_MR of buffer 1 (64 bytes)",
    Command.REG_MR,
    lambda b: {"buffer": b},
    volatile=True,
    note="`desc` is the MrDesc `[ptr, size, [[rail NetAddr, rkey], ...]]`: one rail here, so "
    "one NetAddr (naming that rail only) and one random 64-bit rkey.",
)


@example("ENGINE_DEREG_MR")
def ex_dereg_mr(ds: Daemons) -> Capture:
    with session(ds["main"], "DEREG_MR of region 1") as (c, cap):
        mr, _ = _region(c)
        c.send(Command.DEREG_MR, 3, {"mr": mr})
        c.recv()
    return cap


@example("ENGINE_SINGLE_WRITE", volatile=True)
def ex_single_write(ds: Daemons) -> Capture:
    with nodes(
        ds, "SINGLE_WRITE of 8 bytes from A's region 1 to offset 16 of B's region, "
        "NO_REPLY, immediate 7; then B reads them back"
    ) as (a, b, cap):
        mr, desc = _a_to_b(a, b)
        a.capture = b.capture = cap
        a.send(Command.SINGLE_WRITE, 3,
               {"len": 8, "imm": 7, "src": [mr, 0], "dst": [desc, 16]}, flags=Flag.NO_REPLY)
        a.recv()
        b.send(Command.GET_TENSOR, 3, {"tensor": [1, 16, 8]})
        b.recv()
    cap.note = (
        "The EVENT carries the submit's cmd and seq; it comes once B has acknowledged that "
        "the bytes are in place."
    )
    return cap


@example("ENGINE_PAGED_WRITES", volatile=True)
def ex_paged_writes(ds: Daemons) -> Capture:
    with nodes(
        ds, "PAGED_WRITES of source pages 0 and 2 (4 bytes, stride 4) to destination pages "
        "1 and 3 (stride 8) of B's region, NO_REPLY, immediate 8"
    ) as (a, b, cap):
        mr, desc = _a_to_b(a, b)
        a.capture = cap
        a.send(Command.PAGED_WRITES, 3, _two_pages(mr, desc), flags=Flag.NO_REPLY)
        a.recv()
    cap.note = "`0123` lands at offset 8 and `89ab` at offset 24 of B's region; B counts 2."
    return cap


@example("ENGINE_EXPECT_IMM_COUNT")
def ex_expect_imm_count(ds: Daemons) -> Capture:
    with nodes(ds, "EXPECT_IMM_COUNT on B: immediate 8, count 2") as (a, b, cap):
        mr, desc = _a_to_b(a, b)
        b.capture = cap
        b.send(Command.EXPECT_IMM_COUNT, 3, {"imm": 8, "count": 2})
        b.recv()
        _ask(a, Command.PAGED_WRITES, 94, _two_pages(mr, desc), flags=Flag.NO_REPLY)
        b.recv()
    cap.note = (
        "Between the reply and the EVENT, A wrote two pages to B with immediate 8 (one "
        "PAGED_WRITES, which counts 1 per page). The EVENT carries the seq of the "
        "EXPECT_IMM_COUNT; the two counts are consumed."
    )
    return cap


@example("ENGINE_IMM_COUNT")
def ex_imm_count(ds: Daemons) -> Capture:
    with nodes(ds, "IMM_COUNT on B after one SINGLE_WRITE with immediate 7 landed") as (
        a,
        b,
        cap,
    ):
        mr, desc = _a_to_b(a, b)
        _ask(a, Command.SINGLE_WRITE, 94,
             {"len": 8, "imm": 7, "src": [mr, 0], "dst": [desc, 0]}, flags=Flag.NO_REPLY)
        b.capture = cap
        b.send(Command.IMM_COUNT, 3, {"imm": 7})
        b.recv()
    return cap


@example("ENGINE_ADD_PEER_GROUP", volatile=True)
def ex_add_peer_group(ds: Daemons) -> Capture:
    with nodes(ds, "ADD_PEER_GROUP of B, on A") as (a, b, cap):
        addr = _address(b)
        a.capture = cap
        a.send(Command.ADD_PEER_GROUP, 2, {"addrs": [addr]})
        a.recv()
    return cap


@example("ENGINE_SCATTER", volatile=True)
def ex_scatter(ds: Daemons) -> Capture:
    with nodes(
        ds, "SCATTER of A's bytes 0-3 and 4-7 to offsets 0 and 32 of B's region, no peer "
        "group, NO_REPLY, immediate 5"
    ) as (a, b, cap):
        mr, desc = _a_to_b(a, b)
        a.capture = cap
        a.send(Command.SCATTER, 3, {
            "group": None, "imm": 5, "mr": mr,
            "dsts": [[4, 0, desc, 0], [4, 4, desc, 32]]}, flags=Flag.NO_REPLY)
        a.recv()
    cap.note = "B counts 2 on immediate 5 (one per destination)."
    return cap


@example("ENGINE_BARRIER", volatile=True)
def ex_barrier(ds: Daemons) -> Capture:
    with nodes(ds, "BARRIER to B's region in peer group 1, NO_REPLY, immediate 9") as (
        a,
        b,
        cap,
    ):
        _, desc = _region(b)
        _ask(a, Command.ADD_PEER_GROUP, 94, {"addrs": [_address(b)]})
        a.capture = cap
        a.send(Command.BARRIER, 3, {"group": 1, "imm": 9, "dsts": [desc]}, flags=Flag.NO_REPLY)
        a.recv()
    cap.note = "A zero-byte write: B counts 1 on immediate 9 and no memory changes."
    return cap


@example("ENGINE_SEND_RECV", volatile=True)
def ex_send_recv(ds: Daemons) -> Capture:
    with nodes(
        ds, "SUBMIT_RECVS on B (4 receives of up to 64 bytes), SEND of 8 bytes from A, "
        "both NO_REPLY"
    ) as (a, b, cap):
        addr = _address(b)
        a.capture = b.capture = cap
        b.send(Command.SUBMIT_RECVS, 2, {"len": 64, "count": 4}, flags=Flag.NO_REPLY)
        a.send(Command.SEND, 2, {"addr": addr}, b"hello, B", flags=Flag.NO_REPLY)
        b.recv()
        a.recv()
    cap.note = (
        "B's message EVENT carries the SUBMIT_RECVS's seq, the sender's `[node, group]` and "
        "the message as payload; A's EVENT completes the SEND once B has taken the message."
    )
    return cap


@example("ENGINE_ERR_RKEY", volatile=True)
def ex_err_rkey(ds: Daemons) -> Capture:
    with nodes(
        ds, "SINGLE_WRITE with a forged rkey: B refuses it, A's completion is EVENT|ERROR "
        "NOT_FOUND"
    ) as (a, b, cap):
        mr, desc = _a_to_b(a, b)
        ((rail, rkey),) = desc[2]
        forged = [desc[0], desc[1], [[rail, (rkey + 1) % (1 << 64)]]]
        a.capture = cap
        a.send(Command.SINGLE_WRITE, 3,
               {"len": 8, "imm": 7, "src": [mr, 0], "dst": [forged, 0]}, flags=Flag.NO_REPLY)
        a.recv()
    cap.note = "Nothing was written at B and its immediate 7 did not move."
    return cap


@example("ENGINE_ERR_SUBMIT", volatile=True)
def ex_err_submit(ds: Daemons) -> Capture:
    with session(
        ds["main"], "SINGLE_WRITE from a region that does not exist: refused on arrival, "
        "EVENT|ERROR NOT_FOUND"
    ) as (c, cap):
        _, desc = _region(c)
        c.send(Command.SINGLE_WRITE, 3,
               {"len": 8, "imm": None, "src": [9, 0], "dst": [desc, 0]}, flags=Flag.NO_REPLY)
        c.recv()
    cap.note = (
        "Without NO_REPLY the same failure is a REPLY|ERROR. Either way nothing was sent to "
        "any peer."
    )
    return cap


request_example(
    "ENGINE_ERR_UNKNOWN_COMMAND",
    "ALLOC_UVM_WATCHER (reserved): UNKNOWN_COMMAND",
    Command.ALLOC_UVM_WATCHER,
    note="The connection stays open.",
)


@example("PEER_PLANE", volatile=True)
def ex_peer_plane(ds: Daemons) -> Capture:
    cap = Capture(
        "A peer link to rail 0 of daemon B: HELLO both ways, a WRITE of 4 bytes with "
        "immediate 3, a WRITE with a forged rkey, a SEND"
    )
    with session(ds["b"], cap.title) as (c, _):
        c.capture = None
        _, desc = _region(c)
        ptr, _, ((_rail, rkey),) = desc
        _, _, _, ((host, port),) = msgpack.unpackb(_address(c), raw=False)
    link = Conn(port, cap, host=host, server="daemon B rail 0", me="peer")
    try:
        link.send(PeerCommand.HELLO, 0,
                  {"node": secrets.randbits(64) | 1, "group": 0, "rail": 0, "rails": 1})
        link.recv()
        write = {"op": 1, "part": 0, "parts": 1, "rkey": rkey, "addrs": [ptr + 16],
                 "lens": [4], "count": 1, "imm": 3}
        link.send(PeerCommand.WRITE, 0, write, b"ABCD")
        link.recv()
        forged = {**write, "op": 2, "rkey": (rkey + 1) % (1 << 64)}
        link.send(PeerCommand.WRITE, 0, forged, b"ABCD")
        link.recv()
        link.send(PeerCommand.SEND, 0, {"op": 3, "part": 0}, b"ping")
        link.recv()
    finally:
        link.close()
    cap.note = (
        "This script plays the initiating daemon. The forged WRITE's 4 bytes are read and "
        "dropped; the SEND waits in B's backlog until a receive is posted."
    )
    return cap


# -- rendering ----------------------------------------------------------------------------


def _flag_names(flags: int) -> str:
    names = [f.name for f in Flag if f and flags & f and f.name]
    return " ".join(str(n) for n in names) or "none"


def _hex_lines(label: str, data: bytes, width: int = 16) -> list[str]:
    out = []
    for i in range(0, max(len(data), 1), width):
        chunk = data[i : i + width]
        out.append(f"  {label if i == 0 else '':<8}{chunk.hex(' ')}")
    return out


def _show(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "nil", True: "true", False: "false"}[value]
    if isinstance(value, bytes):
        return "h'" + value.hex() + "'"
    if isinstance(value, dict):
        return "{" + ", ".join(f'"{k}": {_show(v)}' for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value + '"'
    return repr(value)


def _name(cmd: int) -> str:
    """A client command's name, or a peer-plane one's as ``PEER_WRITE``."""
    if cmd in PEER_COMMANDS:
        return f"PEER_{PeerCommand(cmd).name}"
    return command_name(cmd)


def render(cap: Capture) -> str:
    lines = [f"{cap.title}:", "", "```text"]
    for w in cap.wire:
        magic, cmd, flags, seq, body_len, _reserved, payload_len = HEADER.unpack_from(w.raw)
        arrow = f"{w.me} -> {w.server}" if w.sent else f"{w.server} -> {w.me}"
        name = _name(cmd) if magic == b"TD" else f"cmd 0x{cmd:02x} (magic {magic!r})"
        lines.append(
            f"{arrow}  {name}  flags=0x{flags:02x} ({_flag_names(flags)})  seq={seq}  "
            f"body_len={body_len}  payload_len={payload_len}"
        )
        h = w.raw[:HEADER_SIZE]
        fields = (h[0:2], h[2:3], h[3:4], h[4:8], h[8:12], h[12:16], h[16:24])
        lines.append(f"  {'header':<8}" + " | ".join(f.hex(" ") for f in fields))
        body = w.raw[HEADER_SIZE : HEADER_SIZE + body_len] if magic == b"TD" else b""
        if body:
            lines += _hex_lines("body", body)
            lines.append(f"  {'':<8}= {_show(msgpack.unpackb(body, raw=False))}")
        payload = w.raw[HEADER_SIZE + body_len :] if magic == b"TD" else b""
        if payload:
            lines += _hex_lines("payload", payload)
        if not w.sent:
            # The daemon's bytes must parse with the project's own decoder.
            frames = FrameDecoder().feed(w.raw)
            assert len(frames) == 1 and frames[0].seq == seq, "reply does not round-trip"
        lines.append("")
    if cap.closed:
        lines.append("server closes the connection")
    elif lines[-1] == "":
        lines.pop()
    lines.append("```")
    if cap.note:
        lines += ["", cap.note]
    return "\n".join(lines)


# -- reading a block back, and comparing modulo per-run values ---------------------------

CLOSED_LINE = "server closes the connection"
SENDERS = ("client", "peer")  # the ends this script plays


def parse(block: str) -> Capture:
    """The capture a rendered block shows, rebuilt from its hex lines."""
    lines = block.split("\n")
    if not lines or not lines[0].endswith(":") or "```text" not in lines:
        raise ValueError("not a rendered example")
    cap = Capture(lines[0][:-1])
    start = lines.index("```text") + 1
    end = lines.index("```", start)
    rest = lines[end + 1 :]
    cap.note = "\n".join(rest[1:]) if rest else ""
    raw: list[bytearray] = []  # each frame's bytes: header, body, payload in order
    for line in lines[start:end]:
        if not line:
            continue
        if line == CLOSED_LINE:
            cap.closed = True
        elif not line.startswith("  "):
            left, right = line.split("  ")[0].split(" -> ")
            sent = left in SENDERS
            cap.wire.append(Wire(sent, b"", right if sent else left, left if sent else right))
            raw.append(bytearray())
        else:
            data = line[10:]
            if not data.startswith("= "):
                raw[-1] += bytes.fromhex(data.replace("|", " "))
    for w, r in zip(cap.wire, raw, strict=True):
        w.raw = bytes(r)
    return cap


class Canon:
    """Renames per-run values (node ids, ports, rkeys, addresses) in first-seen order."""

    HEXWORD = re.compile(r"\b(?:0x)?[0-9a-f]{8,}\b|:\d{2,5}\b")

    def __init__(self) -> None:
        self.names: dict[tuple[str, Any], str] = {}

    def name(self, kind: str, value: Any) -> str:
        key = (kind, value)
        if key not in self.names:
            n = sum(1 for k in self.names if k[0] == kind) + 1
            self.names[key] = f"<{kind}{n}>"
        return self.names[key]

    def netaddr(self, raw: bytes) -> Any:
        try:
            fmt, node, group, rails = msgpack.unpackb(raw, raw=False)
            if fmt != 1:
                return None
            return ["NetAddr", self.name("node", node), group,
                    [[h, self.name("port", p)] for h, p in rails]]
        except Exception:
            return None

    def mrdesc(self, v: list[Any]) -> Any:
        if len(v) != 3 or not all(type(x) is int for x in v[:2]) or not isinstance(v[2], list):
            return None
        rkeys = []
        for item in v[2]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], bytes)):
                return None
            addr = self.netaddr(item[0])
            if addr is None:
                return None
            rkeys.append([addr, self.name("rkey", item[1])])
        return ["MrDesc", self.name("ptr", v[0]), v[1], rkeys]

    def value(self, v: Any, key: str = "") -> Any:
        if isinstance(v, bytes):
            addr = self.netaddr(v)
            return v if addr is None else addr
        if isinstance(v, dict):
            return {k: self.value(x, k) for k, x in v.items()}
        if isinstance(v, list):
            desc = self.mrdesc(v)
            if desc is not None:
                return desc
            if key == "from" and len(v) == 2:
                return [self.name("node", v[0]), v[1]]
            if key == "addrs" and all(type(x) is int for x in v):
                return [self.name("addr", x) for x in v]
            return [self.value(x, key) for x in v]
        if type(v) is int and key in ("node", "rkey"):
            return self.name(key, v)
        if isinstance(v, str) and key == "message":
            return self.HEXWORD.sub("<n>", v)
        return v


def signature(cap: Capture) -> Any:
    """What a capture shows, with every per-run value renamed."""
    canon = Canon()
    frames = []
    for w in cap.wire:
        magic, cmd, flags, seq, body_len, reserved, _ = HEADER.unpack_from(w.raw)
        body = w.raw[HEADER_SIZE : HEADER_SIZE + body_len]
        decoded = msgpack.unpackb(body, raw=False) if body else None
        frames.append((w.sent, w.me, w.server, magic, cmd, flags, seq, reserved,
                       canon.value(decoded), w.raw[HEADER_SIZE + body_len :]))
    return cap.title, cap.note, cap.closed, frames


def same(block: str, fresh: Capture) -> bool:
    """Whether a volatile example's block in the doc still shows what ``fresh`` does."""
    try:
        shown = parse(block)
        # The block must agree with its own bytes (nobody edited the text by hand) ...
        if render(shown) != block:
            return False
    except (ValueError, AssertionError, IndexError, struct.error):
        return False
    # ... and show the same frames as today's daemon, per-run values aside.
    return signature(shown) == signature(fresh)


def capture_all(names: Sequence[str], jobs: int = 1) -> dict[str, Capture]:
    """Run the examples, each with daemons of its own, ``jobs`` at a time."""

    def one(n: str) -> Capture:
        daemons = Daemons()
        try:
            return EXAMPLES[n](daemons)
        finally:
            daemons.close()

    if hasattr(os, "fork") and Daemon.zygote is None:
        Daemon.zygote = Zygote()
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return dict(zip(names, pool.map(one, names), strict=True))
    finally:
        if Daemon.zygote is not None:
            Daemon.zygote.close()
            Daemon.zygote = None


BLOCK = re.compile(r"(<!-- capture:(\w+) -->\n)(.*?)(<!-- /capture -->)", re.S)


def rewrite(text: str, captures: dict[str, Capture]) -> str:
    """The doc with every captured block brought up to date.

    A volatile example's block is kept as it is while it still shows the same
    frames (only per-run values differ), so the doc does not churn.
    """

    def sub(m: re.Match[str]) -> str:
        name = m.group(2)
        if name not in EXAMPLES:
            raise SystemExit(f"docs/protocol.md names an unknown example {name!r}")
        if name not in captures:
            return m.group(0)
        old = m.group(3)[:-1] if m.group(3).endswith("\n") else m.group(3)
        if name in VOLATILE and same(old, captures[name]):
            return m.group(0)
        return f"{m.group(1)}{render(captures[name])}\n{m.group(4)}"

    return BLOCK.sub(sub, text)


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["--zygote"]:
        Zygote.serve(args_in[1])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite docs/protocol.md in place")
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/protocol.md is stale")
    ap.add_argument(
        "-j", "--jobs", type=int, default=max(4, os.cpu_count() or 1),
        help="examples captured at once (default: max(4, CPUs))",
    )
    ap.add_argument("names", nargs="*", help="only these examples (default: all)")
    args = ap.parse_args(argv)
    names = args.names or list(EXAMPLES)
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        ap.error(f"unknown example(s): {', '.join(unknown)}; have {', '.join(EXAMPLES)}")
    captures = capture_all(names, args.jobs)
    if not (args.write or args.check):
        for n in names:
            print(f"<!-- capture:{n} -->\n{render(captures[n])}\n<!-- /capture -->\n")
        return 0
    text = DOC.read_text()
    in_doc = {m.group(2) for m in BLOCK.finditer(text)}
    missing = [n for n in EXAMPLES if n not in in_doc]
    new = rewrite(text, captures)
    if args.check:
        if new != text or missing:
            if missing:
                print(f"docs/protocol.md lacks blocks for: {', '.join(missing)}", file=sys.stderr)
            if new != text:
                print(
                    "docs/protocol.md is stale: run docs/tools/capture_frames.py --write",
                    file=sys.stderr,
                )
            return 1
        print(f"docs/protocol.md: {len(in_doc)} captured frames are current")
        return 0
    DOC.write_text(new)
    print(f"docs/protocol.md: rewrote {len(in_doc)} blocks")
    if missing:
        print(
            f"not in docs/protocol.md (add a block for each): {', '.join(missing)}", file=sys.stderr
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
