"""The example registry, and the helpers examples are built from.

An example is a function of :class:`~capture.live.Daemons` that returns a
:class:`~capture.live.Capture`; ``@example(NAME)`` registers one under the name
its block in docs/protocol.md has, in the order the examples are defined.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack

from capture.live import Capture, Conn, Daemon, Daemons, Zygote
from transferd.protocol import HEADER, HEADER_SIZE, Command

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
