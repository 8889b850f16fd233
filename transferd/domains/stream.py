"""A framed, non-blocking socket for the peer plane: scatter in, gather out.

Receives go through ``recvmsg_into`` over the list of memoryviews the
decoder names (the pages of a paged write, straight into the region), and
sends through ``sendmsg`` over the views where the data lies.  Nothing bulk
is copied.  Outgoing data waits in a queue of views whose byte count has a
high and a low watermark; ``on_pause``/``on_resume`` tell the owner.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice
from typing import Any

from transferd.protocol import frames
from transferd.protocol.errors import ProtocolError
from transferd.protocol.frames import Frame, FrameDecoder, SinkFactory

log = logging.getLogger("transferd.peer")

IOV_MAX = 512
# Bytes offered to one sendmsg / recvmsg_into.  Each call turns every view it
# is given into an iovec, so offering 512 pages when the socket takes a
# handful costs a buffer lookup per page per call; a call moves at most about
# a socket buffer, so this is what is offered.
SEND_BYTES = 4 << 20
RECV_BYTES = 1 << 20
HIGH_WATER = 64 * 1024 * 1024
LOW_WATER = 16 * 1024 * 1024
# Receives done per readable callback before yielding to other sockets.
READS_PER_WAKEUP = 16


class FramedStream:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        *,
        on_frame: Callable[[Frame], None],
        on_close: Callable[[BaseException | None], None],
        sink: SinkFactory | None = None,
        max_body: int = 16 * 1024 * 1024,
        max_payload: int = 1 << 40,
        buffer_size: int = frames.READ_CHUNK,
    ) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.loop = loop
        self.sock = sock
        self.decoder = FrameDecoder(
            max_body=max_body, max_payload=max_payload, payload_sink=sink, exact=True,
            buffer_size=buffer_size,
        )
        self._on_frame = on_frame
        self._on_close = on_close
        self._out: deque[memoryview] = deque()
        self._out_bytes = 0
        self._writing = False
        self.closed = False
        self.bytes_in = 0
        self.bytes_out = 0
        self.on_pause: Callable[[], None] | None = None
        self.on_resume: Callable[[], None] | None = None
        # The outgoing queue's watermarks (an inbound link sets small ones for its ACKs).
        self.high_water = HIGH_WATER
        self.low_water = LOW_WATER
        self._paused = False
        self._reading = True
        loop.add_reader(sock.fileno(), self._readable)

    # -- receive ----------------------------------------------------------------

    def _readable(self) -> None:
        for _ in range(READS_PER_WAKEUP):
            if self.closed or not self._reading:
                return
            bufs = self.decoder.get_buffers(IOV_MAX, RECV_BYTES)
            try:
                if len(bufs) == 1:
                    n = self.sock.recv_into(bufs[0])
                else:
                    n = self.sock.recvmsg_into(bufs)[0]
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.close(exc)
                return
            if n == 0:
                self.close(None)
                return
            self.bytes_in += n
            self.decoder.buffer_updated(n)
            try:
                while (frame := self.decoder.next_frame()) is not None:
                    self._on_frame(frame)
                    if self.closed or not self._reading:
                        return
            except ProtocolError as exc:
                log.warning("peer stream broken: %s", exc)
                self.close(exc)
                return
            except Exception as exc:
                # A bug, not the peer's doing: this link ends, the daemon goes on.
                log.exception("peer stream: frame handling failed")
                self.close(exc)
                return

    # -- send -------------------------------------------------------------------------

    def send(
        self, cmd: int, flags: int, seq: int, body: dict[str, Any] | None,
        payload: Sequence[memoryview] = (),
    ) -> None:
        if self.closed:
            return
        raw = frames.pack_body(body)
        lens = list(map(len, payload))
        plen = sum(lens)
        head = memoryview(frames.encode_header(cmd, flags, seq, len(raw), plen) + raw)
        self._out.append(head)
        # Empty views stay out of the queue (_flush could not get past a queue of them).
        self._out.extend(payload if 0 not in lens else [p for p in payload if len(p)])
        self._out_bytes += len(head) + plen
        if not self._writing:
            self._flush()
        if not self._paused and self._out_bytes > self.high_water:
            self._paused = True
            if self.on_pause is not None:
                self.on_pause()

    def send_raw(self, data: bytes) -> None:
        """Frames already encoded (the handshake's); nothing if ``data`` is empty."""
        if self.closed or not data:
            return
        self._out.append(memoryview(data))
        self._out_bytes += len(data)
        if not self._writing:
            self._flush()

    def _flush(self) -> None:
        out = self._out
        while out and not self.closed:
            iov = _take(out, SEND_BYTES)
            try:
                n = self.sock.sendmsg(iov)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.close(exc)
                return
            self.bytes_out += n
            self._out_bytes -= n
            # Drop what went out; the first view not sent in full keeps its tail.
            for head in iov:
                if not n:
                    break
                size = len(head)
                if n >= size:
                    n -= size
                    out.popleft()
                else:
                    out[0] = head[n:]
                    break
        want = bool(self._out) and not self.closed
        if want and not self._writing:
            self.loop.add_writer(self.sock.fileno(), self._flush)
            self._writing = True
        elif not want and self._writing:
            self.loop.remove_writer(self.sock.fileno())
            self._writing = False
        if self._paused and self._out_bytes <= self.low_water:
            self._paused = False
            if self.on_resume is not None:
                self.on_resume()

    @property
    def queued(self) -> int:
        return self._out_bytes

    def pause_reading(self) -> None:
        """Read nothing more until :meth:`resume_reading` (a receiver waiting for memory)."""
        if not self.closed and self._reading:
            self._reading = False
            self.loop.remove_reader(self.sock.fileno())

    def resume_reading(self) -> None:
        if not self.closed and not self._reading:
            self._reading = True
            self.loop.add_reader(self.sock.fileno(), self._readable)

    def close(self, exc: BaseException | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        fd = self.sock.fileno()
        if fd >= 0:
            self.loop.remove_reader(fd)
            if self._writing:
                self.loop.remove_writer(fd)
        self._out.clear()
        try:
            self.sock.close()
        except OSError as e:  # pragma: no cover - close rarely fails
            if e.errno != errno.EBADF:
                raise
        self._on_close(exc)


def _take(out: deque[memoryview], limit: int) -> list[memoryview]:
    """The first views of ``out``, up to ``limit`` bytes or IOV_MAX views."""
    iov: list[memoryview] = []
    total = 0
    for view in islice(out, IOV_MAX):
        iov.append(view)
        total += len(view)
        if total >= limit:
            break
    return iov
