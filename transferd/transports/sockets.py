"""An asyncio transport over an AF_UNIX socket that carries file descriptors.

The loop's own Unix transports cannot send or receive SCM_RIGHTS, so unix and
seqpacket connections use this one (tcp and tls keep the loop's native ones).
It drives an ``asyncio.BufferedProtocol`` exactly as the loop would
(``get_buffer`` / ``buffer_updated``, ``pause_writing`` / ``resume_writing``),
plus three additions:

- ``send_fds(fds)``: the descriptors go with the first byte (stream) or the
  first message of the next write.  The caller keeps its own descriptors (the
  kernel duplicates them into the receiver).
- ``received_fds``: a bounded deque of descriptors that arrived, oldest first,
  in the order of the bytes they came with, so the frame that announces N of
  them takes the N oldest (``take_fds``).  Descriptors nobody took are closed
  with the transport.
- In message mode (SOCK_SEQPACKET) frames travel as PROTOCOL.md's
  "Transports" says: header and body one message, a payload as
  ``ceil(payload_len / max_message)`` continuation messages of exactly
  ``max_message`` bytes (the last holds the rest).  Every message is received
  whole, in one ``recvmsg_into`` of a buffer larger than any message allowed
  now, and then scattered into the protocol's buffers; a short, long or merged
  message is BAD_FRAME (the cutting and the judging are
  :mod:`.continuation`'s, shared with rdma://).  Writers use :meth:`write_frame`,
  which cuts a frame into its messages.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import errno
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from transferd.copies import COUNTING, count
from transferd.protocol.constants import HEADER_SIZE
from transferd.protocol.errors import BadFrame, ProtocolError

from .continuation import (
    GONE,
    MIN_MAX_MESSAGE,
    Continuation,
    SplitFrame,
    chunks,
    report_refused,
    scatter,
    write_limits,
)

log = logging.getLogger("transferd.transports")

# At most this many descriptors ride on one message, and at most MAX_HELD_FDS
# wait in received_fds for a frame to take them: a sender that floods us with
# descriptors gets BAD_FRAME, not our fd table.
MAX_FDS_PER_MESSAGE = 16
MAX_HELD_FDS = 64
_ANC_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * array.array("i").itemsize)
_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
_MSG_TRUNC = socket.MSG_TRUNC
# sendmsg takes at most IOV_MAX (1024 on Linux) buffers per call.
_IOV = 512

_scratch = threading.local()


def _scratch_buffer(size: int) -> memoryview:
    """A receive buffer of at least ``size`` bytes, shared by the thread's transports.

    A message is received and scattered within one callback, so one buffer per
    thread serves every connection: an idle connection holds no receive memory.
    """
    view: memoryview | None = getattr(_scratch, "view", None)
    if view is None or len(view) < size:
        view = memoryview(bytearray(max(size, MIN_MAX_MESSAGE)))
        _scratch.view = view
    return view


class SocketTransport(asyncio.Transport):
    """See the module docstring.  Made by the listeners and connectors of this package."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol: asyncio.BufferedProtocol,
        *,
        message: bool,
        max_message: int = MIN_MAX_MESSAGE,
        recv_limit: int | None = None,
        extra: dict[str, Any] | None = None,
        keep_fds: bool = True,
    ) -> None:
        super().__init__(extra)
        # False on the server: no frame a client sends announces descriptors,
        # so whatever rides in is closed on arrival (a stranger cannot fill
        # our fd table, not even up to MAX_HELD_FDS per connection).
        self.keep_fds = keep_fds
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self.message = message
        # Where the frame arriving is (payload continuation, continuation.py); its sizes
        # are the session's to raise once HELLO is done.
        self.continuation = Continuation(max_message, recv_limit if recv_limit is not None
                                         else max_message)
        # The connecting process's (pid, uid, gid) on AF_UNIX (SO_PEERCRED).
        self.peercred = _peercred(sock)
        self._extra = {
            "socket": sock,
            "peername": _peername(sock),
            "peercred": self.peercred,
            "sockname": sock.getsockname(),
            "transferd_fds": True,
            "transferd_message": message,
            **(extra or {}),
        }
        self.received_fds: collections.deque[int] = collections.deque()
        self._send_fds: list[int] = []
        # Write queue: (views, fds) per message (message mode) or per write.
        self._queue: collections.deque[tuple[list[memoryview], list[int]]] = collections.deque()
        self._queued = 0
        self._high = 64 * 1024
        self._low = 16 * 1024
        self._protocol_paused = False
        self._reading = False
        self._closing = False
        self._eof_pending = False  # write_eof() asked: shut down writing once drained
        self._lost = False
        # Message mode: continuation bytes still due for the current frame, and
        # the rest of a message whose scatter was paused by the protocol.
        self._stash: memoryview | None = None
        self._protocol.connection_made(self)
        if not self._closing:
            self._start_reading()

    # -- asyncio.Transport ---------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def is_closing(self) -> bool:
        return self._closing

    def is_reading(self) -> bool:
        return self._reading

    def pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def resume_reading(self) -> None:
        if self._reading or self._closing:
            return
        if self._stash is not None:
            # Reading again for the rest of a paused message first; the protocol may
            # pause again inside it (the rest is kept again), or close.
            self._reading = True
            stash, self._stash = self._stash, None
            self._scatter(stash)
            if not self._reading or self._closing:
                return
        self._start_reading()

    def _start_reading(self) -> None:
        self._reading = True
        self._loop.add_reader(self._fd, self._on_readable)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high, self._low = write_limits(high, low)
        self._maybe_pause_protocol()

    def get_write_buffer_size(self) -> int:
        return self._queued

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        assert isinstance(protocol, asyncio.BufferedProtocol)
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self.pause_reading()
        if not self._queue:
            self._loop.call_soon(self._connection_lost, None)

    def abort(self) -> None:
        self._closing = True
        self.pause_reading()
        self._queue.clear()
        self._queued = 0
        self._loop.call_soon(self._connection_lost, None)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        # Half-close once what is queued has gone: the peer then reads an end
        # of stream (a zero-length receive, on a SOCK_SEQPACKET socket too).
        if self._closing or self._lost or self._eof_pending:
            return
        self._eof_pending = True
        if not self._queue:
            self._shutdown_write()

    def _shutdown_write(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)

    # -- descriptors ------------------------------------------------------------------

    def send_fds(self, fds: Sequence[int]) -> None:
        """Attach ``fds`` to the next write (the caller keeps its own copies)."""
        if len(self._send_fds) + len(fds) > MAX_FDS_PER_MESSAGE:
            raise ValueError(f"at most {MAX_FDS_PER_MESSAGE} descriptors go with one frame")
        self._send_fds.extend(int(fd) for fd in fds)

    def take_fds(self, n: int) -> list[int]:
        """The ``n`` oldest received descriptors (now the caller's to close)."""
        if n > len(self.received_fds):
            raise BadFrame(f"{n} file descriptors announced, {len(self.received_fds)} received")
        return [self.received_fds.popleft() for _ in range(n)]

    def _collect_fds(self, ancdata: list[tuple[int, int, bytes]]) -> None:
        over = False
        for level, kind, data in ancdata:
            if level != socket.SOL_SOCKET or kind != socket.SCM_RIGHTS:
                continue
            fds = array.array("i")
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            for fd in fds:
                if self.keep_fds and not over and len(self.received_fds) < MAX_HELD_FDS:
                    self.received_fds.append(fd)
                    continue
                # Every descriptor of the message is ours once received: close
                # the rest too, not only the one that found the table full.
                over = over or self.keep_fds
                with contextlib.suppress(OSError):
                    os.close(fd)
        if over:
            raise BadFrame(f"more than {MAX_HELD_FDS} file descriptors not taken")

    # -- reading ----------------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            if self.message:
                self._read_message()
            else:
                self._read_stream()
        except ProtocolError as exc:
            self._protocol_error(exc)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._fatal(exc)

    def _read_stream(self) -> None:
        buf = self._protocol.get_buffer(-1)
        n, anc, _flags, _ = self._sock.recvmsg_into([buf], _ANC_SPACE, _CLOEXEC)
        if anc:
            self._collect_fds(anc)
        if n == 0:
            self._eof()
            return
        self._protocol.buffer_updated(n)

    def _read_message(self) -> None:
        want = self.continuation.want
        # One byte more than allowed: a longer message shows as MSG_TRUNC or n > want.
        buf = _scratch_buffer(want + 1)
        n, anc, flags, _ = self._sock.recvmsg_into([buf[: want + 1]], _ANC_SPACE, _CLOEXEC)
        if anc:
            self._collect_fds(anc)
        if n == 0:
            self._eof()
            return
        try:
            self.continuation.judge(buf, n, bool(flags & _MSG_TRUNC))
        except SplitFrame:
            # Let the decoder judge the header first (magic, limits, gate): its error
            # is the more precise one.
            self._scatter(buf[:HEADER_SIZE])
            raise
        self._scatter(buf[:n])

    def _scatter(self, data: memoryview) -> None:
        # One receive buffer serves every message: what a pause left is kept.
        self._stash = scatter(data, self._protocol, self)

    def _eof(self) -> None:
        self.pause_reading()
        keep_open = self._protocol.eof_received()
        if not keep_open:
            self.close()

    def _protocol_error(self, exc: ProtocolError) -> None:
        report_refused(self._protocol, exc, self._extra.get("peername"))
        self.close()

    # -- writing ----------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.message:
            raise RuntimeError("a message transport takes whole frames: use write_frame")
        if data:
            self._write_views([memoryview(data).cast("B")])

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        if self.message:
            raise RuntimeError("a message transport takes whole frames: use write_frame")
        views = [memoryview(d).cast("B") for d in list_of_data]
        if views:
            self._write_views(views)

    def write_frame(self, head: bytes, payload: Sequence[memoryview], payload_len: int) -> None:
        """One frame: ``head`` (header and body), then ``payload`` (views of its bytes)."""
        if not self.message:
            if payload_len:
                self._write_views([memoryview(head), *payload])
            else:
                self._write_views([memoryview(head)])
            return
        if self._closing or self._lost:
            return
        fds, self._send_fds = self._send_fds, []
        msgs: list[tuple[list[memoryview], list[int]]] = [([memoryview(head)], fds)]
        if payload_len:
            for chunk in chunks(payload, self.continuation.max_message):
                if len(chunk) > _IOV:
                    chunk = [memoryview(b"".join(chunk))]
                    if COUNTING:
                        count("transport.join", len(chunk[0]))
                msgs.append((chunk, []))
        for views, mfds in msgs:
            self._queue.append((views, mfds))
            self._queued += sum(map(len, views))
        if len(self._queue) == len(msgs):
            self._flush()
            if self._queue:
                self._loop.add_writer(self._fd, self._on_writable)
        self._maybe_pause_protocol()

    def _write_views(self, views: list[memoryview]) -> None:
        if self._closing or self._lost:
            return
        fds, self._send_fds = self._send_fds, []
        self._queue.append((views, fds))
        self._queued += sum(map(len, views))
        if len(self._queue) == 1:
            self._flush()
            if self._queue:
                self._loop.add_writer(self._fd, self._on_writable)
        self._maybe_pause_protocol()

    def _flush(self) -> None:
        """Send what the socket takes now; stops at EAGAIN."""
        q = self._queue
        sock = self._sock
        while q:
            views, fds = q[0]
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            try:
                n = sock.sendmsg(views[:_IOV], anc)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno == errno.EMSGSIZE:
                    exc = OSError(exc.errno, f"message of {sum(map(len, views))} bytes is "
                                  "bigger than the socket's send buffer")
                self._fatal(exc)
                return
            self._queued -= n
            if fds:
                q[0] = (views, [])
            if self.message:
                q.popleft()  # a message goes whole or not at all
                continue
            # Stream: drop what went, keep the rest of a partly sent write.
            while n:
                if n >= len(views[0]):
                    n -= len(views.pop(0))
                else:
                    views[0] = views[0][n:]
                    n = 0
            if views:
                return  # a short send: wait until the socket takes more
            q.popleft()

    def _on_writable(self) -> None:
        self._flush()
        if self._lost:
            return
        if not self._queue:
            self._loop.remove_writer(self._fd)
            if self._closing:
                self._connection_lost(None)
                return
            if self._eof_pending:
                self._shutdown_write()
        self._maybe_resume_protocol()

    def _maybe_pause_protocol(self) -> None:
        if not self._protocol_paused and self._queued > self._high:
            self._protocol_paused = True
            self._protocol.pause_writing()

    def _maybe_resume_protocol(self) -> None:
        if self._protocol_paused and self._queued <= self._low:
            self._protocol_paused = False
            self._protocol.resume_writing()

    # -- the end ----------------------------------------------------------------------

    def _fatal(self, exc: BaseException) -> None:
        log.debug("%s: transport error: %s", self._extra.get("peername"), exc)
        self._closing = True
        self.pause_reading()
        self._queue.clear()
        self._queued = 0
        self._connection_lost(exc if isinstance(exc, Exception) else None)

    def _connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._closing = True
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)
        with contextlib.suppress(Exception):
            self._loop.remove_writer(self._fd)
        try:
            self._protocol.connection_lost(exc)
        finally:
            self._protocol = GONE  # (no transport <-> protocol cycle left behind)
            self._sock.close()
            while self.received_fds:
                with contextlib.suppress(OSError):
                    os.close(self.received_fds.popleft())


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _peercred(sock: socket.socket) -> tuple[int, int, int] | None:
    """The connecting process's (pid, uid, gid) on an AF_UNIX socket (SO_PEERCRED)."""
    if sock.family != socket.AF_UNIX:
        return None
    try:
        pid, uid, gid = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    return pid, uid, gid


def _peername(sock: socket.socket) -> Any:
    try:
        return sock.getpeername() or "local"
    except OSError:
        return "local"
