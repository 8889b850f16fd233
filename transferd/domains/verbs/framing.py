"""Frames over a message transport (RDMA SEND/RECV), as PROTOCOL.md's "Transports" says.

A frame's header and body are one message of at most the receiver's limit; a payload
follows as ``ceil(payload_len / max_message)`` messages of exactly ``max_message``
bytes, the last holding the remainder.  Every message is received whole, into a buffer
of at least ``max_message`` bytes, and then scattered into its destination; a short, long
or merged message is BAD_FRAME.

Pure (no device, no socket): :func:`cut` turns a frame into its messages,
:class:`MessageReader` judges each received message and hands it on to be scattered,
:func:`scatter` copies one message into an ``asyncio.BufferedProtocol``'s buffers.  The
rdma:// transport (``transferd/transports/rdma.py``) drives them with RC SEND/RECV; the
tests drive them over an AF_UNIX SOCK_SEQPACKET socket pair, which keeps message
boundaries the same way.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

from transferd.copies import COUNTING, count
from transferd.protocol.constants import HEADER_SIZE
from transferd.protocol.errors import BadFrame, TooLarge

# PROTOCOL.md: max_message is at least 65536; the HELLO exchange fits 4096 bytes.
MIN_MAX_MESSAGE = 65536
HELLO_MESSAGE = HEADER_SIZE + 4096
_lengths = struct.Struct("<8xIIQ").unpack_from  # body_len, reserved, payload_len


def cut(head: bytes | memoryview, payload: Sequence[memoryview], payload_len: int,
        max_message: int) -> list[list[memoryview]]:
    """The messages of one frame, each a list of views (gathered by the sender)."""
    if sum(map(len, payload)) != payload_len:
        raise ValueError("payload views do not add up to payload_len")
    msgs: list[list[memoryview]] = [[memoryview(head)]]
    cur: list[memoryview] = []
    room = max_message
    for v in payload:
        v = memoryview(v).cast("B")
        while len(v):
            k = min(room, len(v))
            cur.append(v[:k])
            v = v[k:]
            room -= k
            if room == 0:
                msgs.append(cur)
                cur, room = [], max_message
    if cur:
        msgs.append(cur)
    return msgs


class MessageReader:
    """Judges whole received messages in order; ``deliver`` gets each one that is right."""

    def __init__(self, deliver: Callable[[memoryview], None], *, max_message: int,
                 first_limit: int = HELLO_MESSAGE) -> None:
        self._deliver = deliver
        self.max_message = max_message
        # The largest header-and-body message taken now (HELLO's until it is done).
        self.first_limit = first_limit
        self.payload_left = 0

    @property
    def want(self) -> int:
        """The most bytes the next message may have (exactly this, for a continuation)."""
        left = self.payload_left
        return min(left, self.max_message) if left else self.first_limit

    def feed(self, msg: memoryview) -> None:
        n = len(msg)
        want = self.want
        if self.payload_left:
            if n != want:
                raise BadFrame(f"payload message of {n} bytes where exactly {want} were due")
            self.payload_left -= n
            self._deliver(msg)
            return
        if n < HEADER_SIZE:
            raise BadFrame(f"message of {n} bytes is shorter than a frame header")
        body_len, _reserved, payload_len = _lengths(msg)
        if HEADER_SIZE + body_len > want:
            raise TooLarge(f"frame of {HEADER_SIZE + body_len} bytes is over the message "
                           f"limit of {want}")
        if n != HEADER_SIZE + body_len:
            raise BadFrame(f"message of {n} bytes holds a frame of {HEADER_SIZE + body_len} "
                           "(header and body are one message)")
        self.payload_left = payload_len
        self._deliver(msg)


def scatter(data: memoryview, protocol: Any) -> None:
    """Copy one whole message into a BufferedProtocol's buffers (the one copy a message
    transport makes: the message is in a receive buffer, its bytes go where they belong)."""
    pos, n = 0, len(data)
    while pos < n:
        dst = protocol.get_buffer(n - pos)
        k = min(len(dst), n - pos)
        if k == 0:
            raise BadFrame("receive buffer full")
        dst[:k] = data[pos : pos + k]
        if COUNTING:
            count("verbs.scatter", k)
        pos += k
        protocol.buffer_updated(k)
