"""How one connection's frames go out, typed by the transport's kind.

A :class:`Carrier` is what the RPC session and the client connection write frames to: a
frame's head (header and body, from the one encoder) and its payload views, sent from
where they lie, with the keep-alives (``hold``) of that memory released once the
transport has taken the bytes.  Each :class:`~transferd.transports.base.TransportKind`
says which carrier its connections get (:meth:`TransportKind.carrier`), so nobody probes
a transport for what it can do:

- :class:`StreamCarrier` (tcp, unix): frames back to back, a small payload joined with
  its head; descriptors on unix (:class:`FdChannel`).
- :class:`TlsCarrier` (tls, server side): the same, handed to the SSL layer a chunk at a
  time.
- :class:`MessageCarrier` (seqpacket, rdma): one frame one message, the payload cut into
  ``max_message`` continuations (the transport's ``write_frame``); descriptors on
  seqpacket.

``fds`` is None where the kind carries no descriptors: callers check that, not the
transport.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Protocol

from transferd.copies import COUNTING, count

from .continuation import Continuation

# Payloads of at most this many bytes are joined with their head into one write: one
# syscall instead of two costs a small copy.
SMALL_WRITE = 16 * 1024
# TLS: the most plaintext handed to the SSL layer at once.
TLS_CHUNK = 256 * 1024


class Releasable(Protocol):
    def release(self) -> None: ...


def release_all(hold: Iterable[Releasable]) -> None:
    for r in hold:
        r.release()


class FdTransport(Protocol):
    """A transport that passes descriptors (``transferd.transports.sockets.SocketTransport``)."""

    def send_fds(self, fds: Sequence[int]) -> None: ...

    def take_fds(self, n: int) -> list[int]: ...


class FrameTransport(Protocol):
    """A message transport: whole frames in (SocketTransport in message mode, the RDMA
    MessageTransport)."""

    continuation: Continuation

    def write_frame(self, head: bytes, payload: Sequence[memoryview], payload_len: int
                    ) -> None: ...

    def get_write_buffer_size(self) -> int: ...


class FdChannel:
    """Descriptors over a Unix socket: sent with a frame's first byte, taken by the frame
    that announces them (SCM_RIGHTS; the sender keeps its own copies)."""

    def __init__(self, transport: FdTransport) -> None:
        self._t = transport

    def send(self, fds: Sequence[int]) -> None:
        self._t.send_fds(fds)

    def take(self, n: int) -> list[int]:
        return self._t.take_fds(n)


class Carrier:
    """One connection's output (see the module docstring)."""

    kind: ClassVar[str] = "stream"
    # Whether this kind ever queues bytes on our side (``busy``): a class constant, so the
    # per-frame test of a stream's writes is one attribute, not a property call.
    queues: ClassVar[bool] = False
    # The largest payload ``write`` copies before it returns (-1: none): a larger one is
    # read from where it lies later, so its memory is held until it is out (``keeps``).
    joins_up_to: ClassVar[int] = -1

    def __init__(self, transport: asyncio.Transport, fds: FdChannel | None = None, *,
                 join_counter: str = "send_join") -> None:
        self.transport = transport
        self.fds = fds
        self._join = join_counter
        # Holds on payload memory still in the transport's write buffer.
        self._held: list[Releasable] = []

    @property
    def busy(self) -> bool:
        """Bytes wait on our side, not yet handed to the transport (TLS chunks)."""
        return False

    def pause_on_any_byte(self) -> None:
        """Make the transport report full (pause_writing) whenever a byte waits in it: the
        server stops reading while a reply is unsent (its payload views are live memory)."""
        self.transport.set_write_buffer_limits(high=0, low=0)

    def write(self, head: bytes, payload: Sequence[Any], payload_len: int,
              hold: Sequence[Releasable] = ()) -> None:
        raise NotImplementedError

    def keeps(self, payload_len: int) -> bool:
        """Whether a payload of ``payload_len`` bytes may still be read from where it lies
        after :meth:`write` returns (then its memory must be held until it is out)."""
        return payload_len > self.joins_up_to

    def write_heads(self, heads: Sequence[bytes]) -> None:
        """Frames without payload (completion EVENTs), in order, in one write (after
        whatever this carrier still queues)."""
        self.write(b"".join(heads), (), 0)

    def _keep(self, hold: Sequence[Releasable]) -> None:
        if self.transport.get_write_buffer_size():
            self._held.extend(hold)  # still queued: drained() (or close) lets go
        else:
            release_all(hold)

    def drained(self) -> bool:
        """The transport's write buffer drained (resume_writing): holds go, the next chunks
        go out.  True when nothing of ours waits any more."""
        held, self._held = self._held, []
        release_all(held)
        return True

    def close(self) -> None:
        """The connection is gone: let go of everything held."""
        held, self._held = self._held, []
        release_all(held)

    def set_message_limits(self, max_message: int, recv_limit: int) -> None:
        """A message transport's sizes once the HELLO exchange set them (streams: none)."""


class StreamCarrier(Carrier):
    # A small payload is joined with its head (a copy) before write returns.
    joins_up_to = SMALL_WRITE

    def write(self, head: bytes, payload: Sequence[Any], payload_len: int,
              hold: Sequence[Releasable] = ()) -> None:
        t = self.transport
        if payload_len <= SMALL_WRITE:
            if payload_len:
                if COUNTING:
                    count(self._join, payload_len)
                t.write(b"".join((head, *payload)))
            else:
                t.write(head)
        else:
            # One call for all views: the transport sends them together (a write per
            # view would be a send syscall per tensor).
            t.writelines((head, *payload))
        if hold:
            self._keep(hold)


class MessageCarrier(Carrier):
    kind = "message"

    def __init__(self, transport: Any, fds: FdChannel | None = None, *,
                 join_counter: str = "send_join") -> None:
        super().__init__(transport, fds, join_counter=join_counter)
        self._frames: FrameTransport = transport

    def write(self, head: bytes, payload: Sequence[Any], payload_len: int,
              hold: Sequence[Releasable] = ()) -> None:
        # Header and body one message, the payload cut into max_message messages.
        self._frames.write_frame(head, payload, payload_len)
        if hold:
            self._keep(hold)

    def write_heads(self, heads: Sequence[bytes]) -> None:
        for head in heads:  # one frame one message
            self._frames.write_frame(head, (), 0)

    def set_message_limits(self, max_message: int, recv_limit: int) -> None:
        self._frames.continuation.max_message = max_message
        self._frames.continuation.first_limit = recv_limit


class TlsCarrier(Carrier):
    """Replies over TLS, handed to the SSL layer a chunk at a time as the connection drains.

    The SSL layer encrypts whatever it is given at once, into memory of its own: a GET
    reply written whole to a TLS transport costs a copy the size of the reply (up to
    ``server.max_reply``) for as long as the client does not read it, and a client that
    pipelines GETs and never reads got one such copy per reply the daemon wrote before
    its write buffer reported full (32 MiB for two 16 MiB replies, measured).  Here the
    frames' views (header, body, payload: no copy) wait in a queue and at most
    :data:`TLS_CHUNK` bytes are written while the transport's buffer is below its high
    mark (set to one chunk); the session pumps it again when the transport drains and
    stops reading the connection while anything is queued (:attr:`busy`), so one slow TLS
    reader holds at most about two chunks of ciphertext besides the buffer memory its
    reply refers to (held, released once the last byte went to the SSL layer).
    """

    queues = True

    def __init__(self, transport: asyncio.Transport, fds: FdChannel | None = None, *,
                 join_counter: str = "send_join", chunk: int = TLS_CHUNK) -> None:
        super().__init__(transport, fds, join_counter=join_counter)
        self.chunk = chunk
        # The SSL transport pauses its protocol once its buffer (plaintext waiting plus
        # ciphertext not yet given to the socket's transport) reaches the high mark, and
        # resumes it at the low one.  pump() writes while the buffer is below the high
        # mark, so the write that stops it is the one that paused the protocol: a
        # resume_writing (and the next pump) always follows.  (With uvloop's default
        # 512 KiB mark and a stop at one chunk, the pause never came: a stall.)
        transport.set_write_buffer_limits(high=chunk, low=chunk // 4)
        self._queue: deque[memoryview] = deque()

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    def pause_on_any_byte(self) -> None:
        # The marks are one chunk (set above): with a zero high-water mark uvloop's SSL
        # transport never reports the buffer drained while reading is paused.
        pass

    def write(self, head: bytes, payload: Sequence[Any], payload_len: int,
              hold: Sequence[Releasable] = ()) -> None:
        for v in (head, *payload):
            m = v if type(v) is memoryview else memoryview(v)
            if m.ndim != 1 or m.itemsize != 1:
                m = m.cast("B")
            if len(m):
                self._queue.append(m)
        self._held.extend(hold)
        self._pump()

    def _pump(self) -> bool:
        """Write chunks while the transport's buffer is below one chunk; True if more wait."""
        t = self.transport
        q = self._queue
        while q and not t.is_closing() and t.get_write_buffer_size() < self.chunk:
            budget = self.chunk
            pieces: list[memoryview] = []
            while q and budget:
                v = q[0]
                if len(v) <= budget:
                    pieces.append(q.popleft())
                    budget -= len(v)
                else:
                    pieces.append(v[:budget])
                    q[0] = v[budget:]
                    budget = 0
            t.writelines(pieces)  # encrypted (copied) by the SSL layer now
        if q and t.is_closing():
            self.close()
        if not q:
            # Every byte is in the SSL layer's own memory: the buffers may go.
            held, self._held = self._held, []
            release_all(held)
            return False
        return True

    def drained(self) -> bool:
        return not self._pump()

    def close(self) -> None:
        self._queue.clear()
        super().close()


def no_delay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on a tcp:// or tls:// connection (frames are small and latency matters)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
