"""A real daemon in this process, for feeding its command dispatch hostile frames.

:class:`InProcessDaemon` builds what ``rpc-server`` builds (the BufferTable and metrics
of :class:`transferd.daemon.Daemon`, a :class:`TransferEngine` with its worker thread
and rail, the RPC front end with a tcp listener on 127.0.0.1 port 0) and runs it on a
uvloop loop in a thread of its own.  :meth:`InProcessDaemon.exchange` then plays a
client over a real socket: HELLO, the frames given, and a STATS probe; it returns every
frame the daemon sent and whether the probe was answered.  Nothing is mocked: the
frames go through the real ``Session`` and the real handlers.

A few objects exist from the start so that hostile frames can name real things:
buffers 1 to 3 (4 KiB, 1 MiB, empty), a region on buffer 1 (its MrDesc and the
engine's NetAddr are in :attr:`InProcessDaemon.known`).  :meth:`reset` frees what an
exchange left behind (buffers, regions) so one bad frame does not starve the next.

Used by the property tests of every command handler (tests/unit/test_handlers_properties.py)
and by the atheris target fuzzing/fuzz_dispatch.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from transferd.protocol.constants import PROTO_MAJOR, Command, ErrorCode, Flag
from transferd.protocol.errors import TransferdError
from transferd.protocol.frames import DISCARD, Frame, FrameDecoder, Phase, encode_frame

T = TypeVar("T")

PROBE_SEQ = 0xFFFFFFF0
CODES = {c.value for c in ErrorCode}
# A reply or an event; an error is either with ERROR set.
ANSWER_FLAGS = {int(Flag.REPLY), int(Flag.REPLY | Flag.ERROR), int(Flag.EVENT),
                int(Flag.EVENT | Flag.ERROR)}
# Codes of errors that close the connection (ProtocolError's).
FATAL_CODES = {"BAD_FRAME", "TOO_LARGE", "NO_HELLO", "VERSION_MISMATCH", "UNAUTHORIZED"}

OVERRIDES: dict[str, Any] = {
    "server.host": "127.0.0.1",
    "server.port": 0,
    "metrics.enabled": False,
    "memory.host_limit_mib": 64,
    "memory.max_buffers": 256,
    "engine.peer_port": 0,
    "engine.peer_timeout_s": 1.0,
    "engine.handshake_timeout_s": 1.0,
    "engine.max_recv_pools": 8,
    "engine.max_expectations": 64,
    "server.max_tensors": 4096,
}


class _Errors(logging.Handler):
    """Records the daemon's ERROR records (an untyped exception a handler let out)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


@dataclass
class Exchange:
    """What one client connection got back."""

    frames: list[Frame] = field(default_factory=list)
    probed: bool = False  # the STATS after the hostile frames was answered
    closed: bool = False  # the daemon closed the connection
    # The bytes sent ended at a frame boundary (else the client half-closed after them,
    # with no probe: the daemon was owed the rest of a frame and closes at the EOF).
    whole: bool = True
    # The bytes sent break the framing (a decoder with the daemon's limits refused them):
    # the daemon answers with a fatal error and closes (a reset, when our later bytes are
    # unread; Linux still hands over what arrived before it).
    refused: bool = False
    reset: bool = False
    greeted: bool = True  # the harness said HELLO (else the bytes sent had their own)
    seconds: float = 0.0

    def errors(self) -> list[dict[str, Any]]:
        return [f.body for f in self.frames if f.flags & int(Flag.ERROR)]

    def check(self) -> None:
        """Every frame an answer with a typed error or a body; a close only after a fatal
        error; an open connection still serves (raises AssertionError)."""
        for f in self.frames:
            assert f.flags in ANSWER_FLAGS, f"frame with flags 0x{f.flags:02x}: {f}"
            if f.flags & int(Flag.ERROR):
                code = f.body.get("code")
                assert code in CODES, f"error without a known code: {f.body}"
                assert code != "INTERNAL", f"a handler raised an untyped exception: {f.body}"
                assert isinstance(f.body.get("message"), str), f.body
        if not self.probed:
            assert self.closed, "the daemon neither answered the probe nor closed: a hang"
            fatal = [e for e in self.errors() if e.get("code") in FATAL_CODES]
            # Before the handshake is done any error closes (a malformed HELLO too).
            shook = self.greeted or any(
                f.cmd == Command.HELLO and f.flags == int(Flag.REPLY) for f in self.frames)
            assert fatal or not self.whole or (not shook and self.errors()), \
                f"closed without a fatal error: {self.errors()}"


class InProcessDaemon:
    """See the module docstring.  Use as a context manager."""

    def __init__(self, overrides: dict[str, Any] | None = None) -> None:
        from transferd.config import load

        self.config = load(env={}, overrides={**OVERRIDES, **(overrides or {})})
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.urls: dict[str, str] = {}
        self.known: dict[str, Any] = {}
        self._baseline: set[int] = set()
        self._errors = _Errors()
        self._daemon: Any = None
        self._frontend: Any = None

    # -- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> InProcessDaemon:
        import uvloop

        self.loop = uvloop.new_event_loop()
        self.loop.set_exception_handler(self._loop_exception)
        ready = threading.Event()

        def run() -> None:
            assert self.loop is not None
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="inproc-daemon", daemon=True)
        self._thread.start()
        ready.wait(10)
        logging.getLogger("transferd").addHandler(self._errors)
        try:
            self.call(self._up)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("transferd").removeHandler(self._errors)
        if self.loop is None:
            return
        with contextlib.suppress(Exception):
            self.call(self._down, timeout=15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self.loop.close()
        self.loop = None

    async def _up(self) -> None:
        from rpc_server.server import RpcFrontend
        from transferd.daemon import Daemon

        cfg = self.config
        d = self._daemon = Daemon(cfg)
        await d.node.start_engine()
        d.node.start_service()
        self._frontend = RpcFrontend()
        # Every listener's URL by its scheme (a config may name several: server.listen).
        self.urls = {u.partition(":")[0]: u for u in await self._frontend.start(d)}
        self.port = int(self.urls["tcp"].rpartition(":")[2])
        self._make_baseline()

    def _make_baseline(self) -> None:
        d = self._daemon
        bufs = [d.buffers.alloc("cpu", n) for n in (4096, 1 << 20, 0)]
        region, desc = d.engine.reg_mr(bufs[0])
        self._baseline = {b.id for b in bufs}
        # Updated in place: a caller may hold on to the dict.
        self.known.update(buffers=[b.id for b in bufs], sizes=[b.size for b in bufs],
                          mr=region.id, desc=desc.to_wire(),
                          addr=d.engine.main_address().to_bytes())

    async def _down(self) -> None:
        if self._frontend is not None:
            await self._frontend.close()
        d = self._daemon
        if d is not None:
            await d.node.close()

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
        self._errors.records.append(f"loop: {ctx.get('message')}: {ctx.get('exception')!r}")

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout: float = 30.0) -> T:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    # -- what a test looks at ---------------------------------------------------------

    def take_errors(self) -> list[str]:
        """The daemon's ERROR log records (and loop exceptions) since the last call."""
        out, self._errors.records = self._errors.records, []
        return out

    def reset(self) -> None:
        """Free every buffer (and so region) an exchange made; the baseline stays, or is
        made anew (new ids in :attr:`known`) when an exchange freed part of it."""

        async def free() -> None:
            d = self._daemon
            bufs = d.buffers.snapshot(1 << 20)
            ids = {b.id for b in bufs}
            mr = self.known.get("mr")
            whole = self._baseline <= ids and any(
                r.id == mr for b in bufs if b.id in self._baseline
                for r in d.engine.regions.regions_of(b))
            for buf in bufs:
                if whole and buf.id in self._baseline:
                    continue
                with contextlib.suppress(TransferdError):
                    d.buffers.free_buffer(buf.id)
                    d.engine.buffer_freed(buf)
            if not whole:
                self._make_baseline()

        self.call(free)

    def alive(self) -> bool:
        """A fresh client is served: HELLO and GET_DEVICES answered."""
        ex = self.exchange(encode_frame(Command.GET_DEVICES, 0, 2, None))
        return ex.probed and any(f.seq == 2 and f.flags == int(Flag.REPLY) for f in ex.frames)

    def _judge(self, data: bytes) -> tuple[bool, bool]:
        srv = self.config.server
        return self._judge_with(srv.max_body, srv.max_payload, data)

    @staticmethod
    def _judge_with(max_body: int, max_payload: int, data: bytes) -> tuple[bool, bool]:
        """(whole, refused): whether ``data`` ends at a frame boundary under a daemon's
        limits, and whether its framing is refused (the daemon closes there)."""
        dec = FrameDecoder(max_body=max_body, max_payload=max_payload,
                           payload_sink=lambda f: DISCARD)
        try:
            dec.feed(data)
        except TransferdError:
            return True, True
        return dec.phase is Phase.HEADER and dec._end == dec._start, False

    def exchange(self, data: bytes, timeout: float = 30.0, greet: bool = True) -> Exchange:
        """A client connection: HELLO, ``data`` (raw bytes: frames or anything), a STATS
        probe (or, when ``data`` stops inside a frame, a half-close); every frame the
        daemon sent until the probe's reply, a close, or ``timeout`` (then neither
        ``probed`` nor ``closed``: a hang).  ``greet=False``: no HELLO of ours, ``data``
        is the connection from its first byte (its own handshake, or none)."""
        started = time.monotonic()
        whole, refused = self._judge(data)
        out = Exchange(whole=whole, refused=refused, greeted=greet)
        hello = encode_frame(Command.HELLO, 0, 1, {"major": PROTO_MAJOR, "minor": 2,
                                                   "client": "fuzz"})
        probe = encode_frame(Command.STATS, 0, PROBE_SEQ, None)
        # Reply payloads are not looked at: discarded as they arrive, never collected.
        dec = FrameDecoder(max_body=64 << 20, max_payload=1 << 34, payload_sink=lambda f: DISCARD)
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.setblocking(False)
            todo = memoryview((hello if greet else b"") + data + (probe if out.whole else b""))
            half_closed = False
            greeted = not greet
            deadline = started + timeout
            while not out.probed and not out.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                r, w, _ = select.select([s], [s] if todo else [], [], min(left, 0.5))
                if w:
                    try:
                        todo = todo[s.send(todo):]
                    except (BrokenPipeError, ConnectionResetError):
                        todo = memoryview(b"")
                        out.reset = True
                if not todo and not out.whole and not half_closed:
                    half_closed = True
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_WR)
                if r:
                    try:
                        chunk = s.recv(1 << 20)
                    except ConnectionResetError:
                        chunk = b""
                        out.reset = True
                    if not chunk:
                        out.closed = True
                        break
                    for f in dec.feed(chunk):
                        if not greeted:
                            greeted = True  # the handshake's own reply
                            assert f.cmd == Command.HELLO and f.flags == int(Flag.REPLY), f
                            continue
                        out.frames.append(f)
                        if f.seq == PROBE_SEQ and f.cmd == Command.STATS and \
                                f.flags & int(Flag.REPLY):
                            out.probed = True
        out.seconds = time.monotonic() - started
        return out
