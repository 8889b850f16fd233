"""The peer frames' extension block: the per-part checksum and trace id (issue 20).

The block follows a WRITE's page table (its length is the header's ``ext``, at
most :data:`~.peer_wire.MAX_EXT`), a READ's with RX_EXT (the trace id only), and
an ok READ_DATA's header (its ``mlen``: the checksum of the payload that follows);
it is a run of entries, each ``kind u8, len u8`` and ``len`` bytes:

CRC32C (0x01)  4 bytes, u32 little-endian: CRC32C (Castagnoli) of the payload as
               sent, the pages' bytes in order.  The receiver computes it over
               the bytes it placed before anything is counted or acknowledged.
TRACE  (0x02)  26 bytes: a W3C traceparent (version u8, trace id 16 bytes, parent
               id 8 bytes, flags u8), :mod:`.trace`.

A kind below 0x80 must be understood: an unknown one refuses the frame
(BAD_REQUEST), so no sender can rely on something skipped unread.  A kind of
0x80 and above may be skipped.  An entry twice, a length that does not fit its
kind or runs past the block: BAD_REQUEST (the framing holds; the block's length
is in the header).
"""

from __future__ import annotations

import struct

from .errors import BadRequest
from .trace import WIRE_LEN as TRACE_LEN

CRC32C = 0x01
TRACE = 0x02
# Kinds from here on may be skipped by a receiver that does not know them.
SKIPPABLE = 0x80

_CRC = struct.Struct("<BBI")
_SIZES = {CRC32C: 4, TRACE: TRACE_LEN}


def encode_ext(crc: int | None, trace: bytes | None) -> bytes:
    """The block for a part's checksum and trace id (b"" for neither)."""
    out = b"" if crc is None else _CRC.pack(CRC32C, 4, crc)
    if trace is not None:
        out += bytes((TRACE, TRACE_LEN)) + trace
    return out


def parse_ext(buf: bytes | bytearray | memoryview, pos: int, n: int, what: str = "WRITE"
              ) -> tuple[int | None, bytes | None]:
    """(checksum, trace id) of the ``n``-byte block at ``pos``; BadRequest if it is wrong
    (``what``: the frame it is of, for the message)."""
    crc: int | None = None
    trace: bytes | None = None
    seen = 0
    end = pos + n
    while pos < end:
        if end - pos < 2:
            raise BadRequest(f"peer {what}: an extension entry cut short")
        kind, size = buf[pos], buf[pos + 1]
        pos += 2
        if pos + size > end:
            raise BadRequest(f"peer {what}: extension entry 0x{kind:02x} of {size} bytes "
                             "runs past its block")
        if kind in _SIZES:
            if size != _SIZES[kind]:
                raise BadRequest(f"peer {what}: extension entry 0x{kind:02x} of {size} "
                                 f"bytes (it has {_SIZES[kind]})")
            if seen & (1 << kind):
                raise BadRequest(f"peer {what}: extension entry 0x{kind:02x} twice")
            seen |= 1 << kind
            if kind == CRC32C:
                crc = int.from_bytes(buf[pos:pos + 4], "little")
            else:
                trace = bytes(buf[pos:pos + size])
        elif kind < SKIPPABLE:
            raise BadRequest(f"peer {what}: extension entry 0x{kind:02x} is unknown here "
                             "and may not be skipped")
        pos += size
    return crc, trace


__all__ = ["CRC32C", "SKIPPABLE", "TRACE", "encode_ext", "parse_ext"]
