"""Payload continuation: frames over a transport of whole messages, as PROTOCOL.md's
"Transports" says, once for every message transport (seqpacket and rdma alike).

A frame's header and body are one message of at most the receiver's limit; a payload
follows as ``ceil(payload_len / max_message)`` messages of exactly ``max_message``
bytes, the last holding the remainder.  Every message is received whole, into a
buffer of at least the largest message allowed now, and then scattered into its
destination; a short, long or merged message is BAD_FRAME.

Pure (no socket, no device): :func:`chunks` and :func:`cut` turn a frame into its
messages, :class:`Continuation` judges each received message (how long the next may
be, and whether the one that came is right), :class:`MessageReader` judges and hands
on, :func:`scatter` copies one message into an ``asyncio.BufferedProtocol``'s
buffers.  ``sockets.SocketTransport`` (seqpacket) and ``msgtransport.MessageTransport``
(rdma://, or any carrier of whole messages) drive them; both take asyncio's write
limits from :func:`write_limits` and tell their protocol of a refused frame through
:func:`report_refused`.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from transferd.copies import COUNTING, count
from transferd.protocol.constants import HEADER_SIZE
from transferd.protocol.errors import BadFrame, TooLarge

# PROTOCOL.md: max_message is at least 65536; the HELLO exchange fits 4096 bytes.
MIN_MAX_MESSAGE = 65536
HELLO_MESSAGE = HEADER_SIZE + 4096
_lengths = struct.Struct("<8xIIQ").unpack_from  # body_len, reserved, payload_len

log = logging.getLogger("transferd.transports")


class SplitFrame(BadFrame):
    """A message that holds more or less than its frame's header and body."""


def chunks(views: Sequence[memoryview], size: int) -> Iterator[list[memoryview]]:
    """Payload views cut into messages of exactly ``size`` bytes (the last: the rest)."""
    cur: list[memoryview] = []
    room = size
    for v in views:
        if type(v) is not memoryview or v.format != "B":
            v = memoryview(v).cast("B")
        while len(v):
            k = min(room, len(v))
            cur.append(v[:k])
            v = v[k:]
            room -= k
            if room == 0:
                yield cur
                cur = []
                room = size
    if cur:
        yield cur


def cut(head: bytes | memoryview, payload: Sequence[memoryview], payload_len: int,
        max_message: int) -> list[list[memoryview]]:
    """The messages of one frame, each a list of views (gathered by the sender)."""
    if sum(map(len, payload)) != payload_len:
        raise ValueError("payload views do not add up to payload_len")
    return [[memoryview(head)], *chunks(payload, max_message)]


class Continuation:
    """Where a reader of whole messages is in the frame that is arriving."""

    def __init__(self, max_message: int, first_limit: int = HELLO_MESSAGE) -> None:
        self.max_message = max_message
        # The largest header-and-body message taken now (HELLO's until it is done).
        self.first_limit = first_limit
        self.payload_left = 0

    @property
    def want(self) -> int:
        """The most bytes the next message may have (exactly this, for a continuation)."""
        left = self.payload_left
        return min(left, self.max_message) if left else self.first_limit

    def judge(self, head: bytes | bytearray | memoryview, n: int,
              truncated: bool = False) -> None:
        """One whole message of ``n`` bytes (``head``: at least its first HEADER_SIZE
        bytes, if it has them; ``truncated``: the carrier cut it) is right here, or
        BadFrame / TooLarge (SplitFrame for a header message whose length is not its
        frame's header and body: the decoder may judge that header first)."""
        want = self.want
        left = self.payload_left
        if left:
            if n != want or truncated:
                got = n if n <= want and not truncated else f"more than {want}"
                raise BadFrame(f"payload message of {got} bytes where exactly {want} "
                               "were due")
            self.payload_left = left - n
            return
        if n < HEADER_SIZE:
            raise BadFrame(f"message of {n} bytes is shorter than a frame header")
        body_len, _reserved, payload_len = _lengths(head)
        if n > want or truncated:
            if HEADER_SIZE + body_len > want:
                raise TooLarge(f"frame of {HEADER_SIZE + body_len} bytes is over the message "
                               f"limit of {want}")
            raise BadFrame("message longer than the frame its header announces")
        if n != HEADER_SIZE + body_len:
            raise SplitFrame(f"message of {n} bytes holds a frame of {HEADER_SIZE + body_len} "
                             "(header and body are one message)")
        self.payload_left = payload_len


class _Gone(asyncio.BufferedProtocol):
    """The protocol of a transport whose connection is lost (every call a no-op).

    A transport holds its protocol and the protocol (a session, a client connection)
    holds its transport: once ``connection_lost`` has been called the transport lets go
    of it for this, as asyncio's own transports do, so that the pair is not a reference
    cycle left for the cyclic collector at every close."""

    def get_buffer(self, sizehint: int) -> memoryview:  # pragma: no cover - never read
        return memoryview(bytearray(1))

    def buffer_updated(self, nbytes: int) -> None:  # pragma: no cover - never read
        pass


GONE = _Gone()


def write_limits(high: int | None, low: int | None) -> tuple[int, int]:
    """``set_write_buffer_limits``'s (high, low), as asyncio's transports default them:
    64 KiB, or four times ``low``; a quarter of ``high``."""
    if high is None:
        high = 64 * 1024 if low is None else 4 * low
    if low is None:
        low = high // 4
    return high, low


def report_refused(protocol: Any, exc: Exception, peername: Any) -> None:
    """A frame the transport refused, told to its protocol (its ``transport_error``, a
    session's or a client connection's), or logged where it has none; the transport
    closes after."""
    tell = getattr(protocol, "transport_error", None)
    if tell is not None:
        tell(exc)
    else:
        log.info("%s: %s", peername, exc)


def _drop(msg: memoryview) -> None:
    """A closed reader's deliver."""


class MessageReader(Continuation):
    """Judges whole received messages in order; ``deliver`` gets each one that is right."""

    def __init__(self, deliver: Callable[[memoryview], None], *, max_message: int,
                 first_limit: int = HELLO_MESSAGE) -> None:
        super().__init__(max_message, first_limit)
        self._deliver = deliver

    def feed(self, msg: memoryview) -> None:
        self.judge(msg, len(msg))
        self._deliver(msg)

    def close(self) -> None:
        """No message is delivered again (``deliver``, a method of what holds this
        reader, is let go: no reference cycle is left once the transport is lost)."""
        self._deliver = _drop


class _Receiving(Protocol):
    def is_closing(self) -> bool: ...
    def is_reading(self) -> bool: ...


def scatter(data: memoryview, protocol: Any, transport: _Receiving) -> memoryview | None:
    """Copy one whole message into a BufferedProtocol's buffers (the one copy a message
    transport makes: the message is in a receive buffer, its bytes go where they belong).

    Returns the rest (a copy) when ``transport`` stops reading part way, e.g. while a
    zero-copy reply is in flight: the receive buffer is reused once this returns, so the
    transport keeps the rest and scatters it again on ``resume_reading``. Stops quietly
    once the transport is closing."""
    pos, n = 0, len(data)
    while pos < n:
        if transport.is_closing():
            return None
        if not transport.is_reading():
            if COUNTING:
                count("transport.stash", n - pos)
            return memoryview(bytes(data[pos:]))
        dst = protocol.get_buffer(n - pos)
        k = min(len(dst), n - pos)
        if k == 0:
            raise BadFrame("receive buffer full")
        dst[:k] = data[pos : pos + k]
        if COUNTING:
            count("transport.scatter", k)
        pos += k
        protocol.buffer_updated(k)
    return None


__all__ = ["HELLO_MESSAGE", "MIN_MAX_MESSAGE", "Continuation", "MessageReader", "SplitFrame",
           "chunks", "cut", "report_refused", "scatter", "write_limits"]
