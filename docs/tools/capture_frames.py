#!/usr/bin/env python3
"""Regenerate the example frames in docs/protocol.md from a live daemon.

Every example is real traffic: requests are built with
``transferd.protocol.encode_frame`` and sent over a plain TCP socket to a
daemon this script starts (``python -m rpc_server.cli -p 0``), and replies are
the exact bytes the daemon sent back.  Nothing is typed by hand.

    python docs/tools/capture_frames.py            # print every example
    python docs/tools/capture_frames.py --write    # rewrite the blocks in docs/protocol.md
    python docs/tools/capture_frames.py --check    # exit 1 if docs/protocol.md is stale

In docs/protocol.md each example lives between ``<!-- capture:NAME -->`` and
``<!-- /capture -->``; ``--write`` replaces what is between the markers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

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

DOC = REPO / "docs" / "protocol.md"
CLIENT_NAME = "capture_frames/1"
TOKEN = "s3cret"


# -- a daemon and a raw connection ---------------------------------------------------


class Daemon:
    """``rpc-server`` as a child process on a port of the system's choosing."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
        cmd = [sys.executable, "-m", "rpc_server.cli", "-H", "127.0.0.1", "-p", "0"]
        cmd += ["--metrics-port", "-1", "--log-level", "error", *args]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.port = 0
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 30
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
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
        if self.proc.poll() is None:
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


@dataclass
class Capture:
    title: str
    wire: list[Wire] = field(default_factory=list)
    closed: bool = False  # the server closed the connection after the last frame
    note: str = ""


class Conn:
    def __init__(self, port: int, capture: Capture | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.capture = capture

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
            self.capture.wire.append(Wire(True, raw))

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
            self.capture.wire.append(Wire(False, raw))
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
        body = {"major": PROTO_MAJOR, "minor": PROTO_MINOR, "client": CLIENT_NAME, **extra}
        self.send(Command.HELLO, seq, body)
        return self.recv()

    def close(self) -> None:
        self.sock.close()


# -- the examples -----------------------------------------------------------------------


class Daemons:
    """The daemons one example talks to, each started fresh on first use.

    ``main`` is a default ``rpc-server``; ``minor1`` runs with ``--protocol-minor
    1``; ``token`` requires ``--token s3cret``.  A fresh daemon per example keeps
    buffer ids and counters the same whichever examples are run.
    """

    ARGS: ClassVar[dict[str, tuple[str, ...]]] = {
        "main": (),
        "minor1": ("--protocol-minor", "1"),
        "token": ("--token", TOKEN),
    }

    def __init__(self) -> None:
        self._running: dict[str, Daemon] = {}

    def __getitem__(self, kind: str) -> Daemon:
        if kind not in self._running:
            self._running[kind] = Daemon(*self.ARGS[kind])
        return self._running[kind]

    def close(self) -> None:
        for d in self._running.values():
            d.close()
        self._running.clear()


Example = Callable[[Daemons], Capture]
EXAMPLES: dict[str, Example] = {}


def example(name: str) -> Callable[[Example], Example]:
    def register(fn: Example) -> Example:
        EXAMPLES[name] = fn
        return fn

    return register


@contextlib.contextmanager
def session(
    d: Daemon, title: str, *, hello: bool = True, token: str | None = None
) -> Iterator[tuple[Conn, Capture]]:
    """A fresh connection, HELLO done off the record unless ``hello`` is False."""
    cap = Capture(title)
    c = Conn(d.port)
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


def _with_buffer(c: Conn, size: int = 64) -> int:
    """Allocate a buffer off the record; returns its id."""
    cap, c.capture = c.capture, None
    c.send(Command.ALLOC_BUFFER, 90, {"device": "cpu", "size": size})
    body = msgpack.unpackb(_body_of(c.recv()))
    c.capture = cap
    return int(body["buffer"])


def _quiet(c: Conn, cmd: int, seq: int, body: dict[str, Any], payload: bytes = b"") -> None:
    cap, c.capture = c.capture, None
    c.send(cmd, seq, body, payload)
    c.recv()
    c.capture = cap


def _body_of(raw: bytes) -> bytes:
    _, _, _, _, body_len, _, _ = HEADER.unpack_from(raw)
    return raw[HEADER_SIZE : HEADER_SIZE + body_len]


@example("HELLO")
def ex_hello(ds: Daemons) -> Capture:
    with session(ds["main"], "HELLO to a minor-2 server", hello=False) as (c, cap):
        c.hello()
    return cap


@example("HELLO_MINOR1")
def ex_hello_minor1(ds: Daemons) -> Capture:
    with session(ds["minor1"], "HELLO to `rpc-server --protocol-minor 1`", hello=False) as (
        c,
        cap,
    ):
        c.hello()
    return cap


@example("HELLO_TOKEN")
def ex_hello_token(ds: Daemons) -> Capture:
    with session(
        ds["token"], f"HELLO with a token (`rpc-server --token {TOKEN}`)", hello=False
    ) as (
        c,
        cap,
    ):
        c.hello(token=TOKEN)
    return cap


@example("GET_DEVICES")
def ex_get_devices(ds: Daemons) -> Capture:
    with session(ds["main"], "GET_DEVICES (empty body both ways but for the list)") as (c, cap):
        c.send(Command.GET_DEVICES, 2)
        c.recv()
    return cap


@example("ALLOC_BUFFER")
def ex_alloc(ds: Daemons) -> Capture:
    with session(ds["main"], "ALLOC_BUFFER of 64 bytes on cpu") as (c, cap):
        c.send(Command.ALLOC_BUFFER, 2, {"device": "cpu", "size": 64})
        c.recv()
    return cap


@example("FREE_BUFFER")
def ex_free(ds: Daemons) -> Capture:
    with session(ds["main"], "FREE_BUFFER") as (c, cap):
        b = _with_buffer(c)
        c.send(Command.FREE_BUFFER, 3, {"buffer": b})
        c.recv()
    return cap


@example("BUFFER_CLEAR")
def ex_clear(ds: Daemons) -> Capture:
    with session(ds["main"], "BUFFER_CLEAR to 0xAB") as (c, cap):
        b = _with_buffer(c)
        c.send(Command.BUFFER_CLEAR, 3, {"buffer": b, "value": 0xAB})
        c.recv()
    return cap


@example("SET_TENSOR")
def ex_set(ds: Daemons) -> Capture:
    with session(ds["main"], "SET_TENSOR of 8 bytes at offset 0, with a reply") as (c, cap):
        b = _with_buffer(c)
        c.send(Command.SET_TENSOR, 3, {"tensor": [b, 0, 8]}, b"01234567")
        c.recv()
    return cap


@example("SET_TENSOR_NO_REPLY")
def ex_set_oneway(ds: Daemons) -> Capture:
    with session(ds["main"], "SET_TENSOR with NO_REPLY: nothing comes back") as (c, cap):
        b = _with_buffer(c)
        c.send(Command.SET_TENSOR, 3, {"tensor": [b, 0, 4]}, b"abcd", flags=Flag.NO_REPLY)
        c.expect_silence()
    cap.note = "No frame comes back."
    return cap


@example("GET_TENSOR")
def ex_get(ds: Daemons) -> Capture:
    with session(ds["main"], "GET_TENSOR of 8 bytes") as (c, cap):
        b = _with_buffer(c)
        _quiet(c, Command.SET_TENSOR, 3, {"tensor": [b, 0, 8]}, b"01234567")
        c.send(Command.GET_TENSOR, 4, {"tensor": [b, 0, 8]})
        c.recv()
    return cap


@example("COPY_TENSOR")
def ex_copy(ds: Daemons) -> Capture:
    with session(ds["main"], "COPY_TENSOR of 8 bytes within one buffer") as (c, cap):
        b = _with_buffer(c)
        c.send(Command.COPY_TENSOR, 3, {"src": [b, 0, 8], "dst": [b, 8, 8]})
        c.recv()
    return cap


@example("SYNCHRONIZE")
def ex_sync(ds: Daemons) -> Capture:
    with session(ds["main"], "SYNCHRONIZE") as (c, cap):
        c.send(Command.SYNCHRONIZE, 2)
        c.recv()
    return cap


@example("STATS")
def ex_stats(ds: Daemons) -> Capture:
    with session(ds["main"], "STATS on a fresh daemon that has seen one HELLO") as (c, cap):
        c.send(Command.STATS, 2)
        c.recv()
    return cap


@example("SET_TENSORS")
def ex_sets(ds: Daemons) -> Capture:
    with session(
        ds["main"], "SET_TENSORS of two 4-byte tensors, NO_REPLY (as the client's flush sends it)"
    ) as (c, cap):
        b = _with_buffer(c)
        c.send(
            Command.SET_TENSORS,
            3,
            {"tensors": [[b, 0, 4], [b, 16, 4]]},
            b"AAAABBBB",
            flags=Flag.NO_REPLY,
        )
        c.expect_silence()
    cap.note = "No frame comes back; without NO_REPLY the reply is an empty REPLY frame."
    return cap


@example("GET_TENSORS")
def ex_gets(ds: Daemons) -> Capture:
    with session(ds["main"], "GET_TENSORS of two 4-byte tensors") as (c, cap):
        b = _with_buffer(c)
        _quiet(c, Command.SET_TENSORS, 3, {"tensors": [[b, 0, 4], [b, 16, 4]]}, b"AAAABBBB")
        c.send(Command.GET_TENSORS, 4, {"tensors": [[b, 16, 4], [b, 0, 4]]})
        c.recv()
    return cap


# -- errors -------------------------------------------------------------------------------


@example("ERR_OUT_OF_BOUNDS")
def ex_oob(ds: Daemons) -> Capture:
    with session(ds["main"], "GET_TENSOR past the end of a 64-byte buffer: OUT_OF_BOUNDS") as (
        c,
        cap,
    ):
        b = _with_buffer(c)
        c.send(Command.GET_TENSOR, 3, {"tensor": [b, 60, 8]})
        c.recv()
    return cap


@example("ERR_NOT_FOUND")
def ex_not_found(ds: Daemons) -> Capture:
    with session(ds["main"], "FREE_BUFFER of a buffer that does not exist: NOT_FOUND") as (c, cap):
        c.send(Command.FREE_BUFFER, 2, {"buffer": 999})
        c.recv()
    return cap


@example("ERR_BAD_REQUEST")
def ex_bad_request(ds: Daemons) -> Capture:
    with session(ds["main"], "ALLOC_BUFFER without its size: BAD_REQUEST") as (c, cap):
        c.send(Command.ALLOC_BUFFER, 2, {"device": "cpu"})
        c.recv()
    return cap


@example("ERR_OUT_OF_MEMORY")
def ex_oom(ds: Daemons) -> Capture:
    with session(ds["main"], "ALLOC_BUFFER of 1 TiB: OUT_OF_MEMORY") as (c, cap):
        c.send(Command.ALLOC_BUFFER, 2, {"device": "cpu", "size": 1 << 40})
        c.recv()
    return cap


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


@example("ERR_UNKNOWN_COMMAND")
def ex_unknown(ds: Daemons) -> Capture:
    with session(ds["minor1"], "GET_TENSORS to a `--protocol-minor 1` server: UNKNOWN_COMMAND") as (
        c,
        cap,
    ):
        c.send(Command.GET_TENSORS, 2, {"tensors": [[1, 0, 4]]})
        c.recv()
    cap.note = "The connection stays open."
    return cap


@example("ERR_NO_HELLO")
def ex_no_hello(ds: Daemons) -> Capture:
    with session(
        ds["main"], "GET_DEVICES as the first frame: NO_HELLO, then close", hello=False
    ) as (
        c,
        cap,
    ):
        c.send(Command.GET_DEVICES, 1)
        c.recv()
        c.expect_close()
    return cap


@example("ERR_VERSION_MISMATCH")
def ex_version(ds: Daemons) -> Capture:
    with session(ds["main"], "HELLO with major 2: VERSION_MISMATCH, then close", hello=False) as (
        c,
        cap,
    ):
        c.send(Command.HELLO, 1, {"major": 2, "minor": 0, "client": CLIENT_NAME})
        c.recv()
        c.expect_close()
    return cap


@example("ERR_UNAUTHORIZED")
def ex_unauthorized(ds: Daemons) -> Capture:
    with session(
        ds["token"], "HELLO without the token the server requires: UNAUTHORIZED", hello=False
    ) as (
        c,
        cap,
    ):
        c.hello()
        c.expect_close()
    return cap


@example("ERR_BAD_FRAME")
def ex_bad_frame(ds: Daemons) -> Capture:
    with session(ds["main"], "A header with a bad magic: BAD_FRAME, then close") as (c, cap):
        good = encode_frame(Command.SYNCHRONIZE, 0, 2)
        c.send(0, 0, raw=b"XX" + good[2:])
        c.recv()
        c.expect_close()
    return cap


@example("ERR_TOO_LARGE")
def ex_too_large(ds: Daemons) -> Capture:
    with session(ds["main"], "A header announcing a 1 TiB payload: TOO_LARGE, then close") as (
        c,
        cap,
    ):
        c.send(0, 0, raw=encode_frame(Command.SET_TENSOR, 0, 2, None, 1 << 40))
        c.recv()
        c.expect_close()
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
    if isinstance(value, bytes):
        return "h'" + value.hex() + "'"
    if isinstance(value, dict):
        return "{" + ", ".join(f'"{k}": {_show(v)}' for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, str):
        return '"' + value + '"'
    return repr(value)


def render(cap: Capture) -> str:
    lines = [f"{cap.title}:", "", "```text"]
    for w in cap.wire:
        magic, cmd, flags, seq, body_len, _reserved, payload_len = HEADER.unpack_from(w.raw)
        arrow = "client -> server" if w.sent else "server -> client"
        name = command_name(cmd) if magic == b"TD" else f"cmd 0x{cmd:02x} (magic {magic!r})"
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


def capture_all(names: Sequence[str]) -> dict[str, str]:
    out = {}
    for n in names:
        daemons = Daemons()
        try:
            out[n] = render(EXAMPLES[n](daemons))
        finally:
            daemons.close()
    return out


BLOCK = re.compile(r"(<!-- capture:(\w+) -->\n)(.*?)(<!-- /capture -->)", re.S)


def rewrite(text: str, rendered: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(2)
        if name not in rendered:
            raise SystemExit(f"docs/protocol.md names an unknown example {name!r}")
        return f"{m.group(1)}{rendered[name]}\n{m.group(4)}"

    return BLOCK.sub(sub, text)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite docs/protocol.md in place")
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/protocol.md is stale")
    ap.add_argument("names", nargs="*", help="only these examples (default: all)")
    args = ap.parse_args(argv)
    names = args.names or list(EXAMPLES)
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        ap.error(f"unknown example(s): {', '.join(unknown)}; have {', '.join(EXAMPLES)}")
    rendered = capture_all(names)
    if not (args.write or args.check):
        for n in names:
            print(f"<!-- capture:{n} -->\n{rendered[n]}\n<!-- /capture -->\n")
        return 0
    text = DOC.read_text()
    in_doc = {m.group(2) for m in BLOCK.finditer(text)}
    missing = [n for n in EXAMPLES if n not in in_doc]
    new = rewrite(text, rendered)
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
