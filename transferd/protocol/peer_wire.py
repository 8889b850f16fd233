"""The peer plane's data phase on the wire: fixed little-endian headers, no msgpack.

After the handshake (:mod:`.peer_handshake`, 24-byte frames with msgpack bodies) a
link carries only these frames, each starting with its command byte.  A small write is
one 64-byte header and its payload; its acknowledgement 16 bytes.  Nothing here is a
dict or a msgpack body: a header is one ``struct`` unpack.

WRITE  (0x41)  48 bytes: cmd u8, flags u8, npages u16, part u32, op u64, rkey u64,
               imm u32, ext u32, wid u64, payload u64
               [span: addr u64, len u64]                     if flags & SPAN
               pages: npages x (addr u64, len u64), or        (flags & UNIFORM: one len u64,
               then npages x addr u64)
               [ext bytes]                                    (peer_ext: checksum, trace id)
               payload: ``payload`` bytes, the pages' bytes concatenated
ACK    (0x42)  16 bytes: cmd u8, status u8 (0 ok, 1 error), mlen u16, part u32, op u64
               [mlen bytes: the error's code, NUL, its message (UTF-8)]
SEND   (0x43)  24 bytes: cmd u8, flags u8, ext u16, part u32, op u64, payload u64
               [ext bytes]                                    if flags & TX_EXT
                                                              (peer_ext: trace id)
               payload: the message (``payload`` bytes)
READ   (0x46)  32 bytes: cmd u8, flags u8, npages u16, part u32, op u64, rkey u64,
               total u64
               [ext u32, 0 u32]                               if flags & RX_EXT
               pages: npages x (addr u64, len u64), at the responder, adding up to total
               [ext bytes]                                    (peer_ext: trace id)
READ_DATA (0x47) 24 bytes: cmd u8, status u8 (0 ok, 1 error), mlen u16, part u32,
               op u64, payload u64
               [mlen bytes: the error's code, NUL, its message]  (status 1: payload 0)
               [mlen bytes: an extension block (peer_ext: the payload's CRC32C)]
                                                              (status 0, mlen > 0)
               payload: exactly the READ's ``total`` bytes, its pages in order
SETUP  (0x4E)  8 bytes: cmd u8, status u8 (0 ok, 1 error), 0 u16, length u32
               [length bytes, at most 4096: the Domain's own set-up (verbs: its queue
               pairs), or an error's code, NUL, its message]; one each way, after the
               handshake and before any other frame, only on a Domain that has one

Flags of a WRITE: IMM (``imm`` counts), SPAN (a part of a single write split in
several: the whole write's range follows), WID (``wid`` is the client's write id),
AGAIN (re-sent on another rail after its own failed), UNIFORM (every page has one
length, given once).

A READ (issue 19) goes on the link the reader dialled, like a WRITE; the responder
answers on the same connection with one READ_DATA whose payload it sends straight from
the region (views, never copied); the reader receives it straight into its own region,
and cuts the link, before a byte lands, on a READ_DATA for a read it never asked or of
another length than asked.

Flags of a READ (issue 20; a READ without them is the 32 bytes it always was):
RX_CRC (0x01) asks the responder for the CRC32C of the bytes it answers with, taken
from its region and sent as the READ_DATA's extension block (a CRC32C entry); the
reader takes its own over the bytes as they are placed and refuses a mismatch
(INTEGRITY: the part is re-read once) or an answer without one.  RX_EXT (0x02): the
fixed part is 40 bytes, its last 8 the length of an extension block after the page
table (peer_ext: the reader's trace id, for the responder's log records).  A daemon
from before issue 20 refuses any flag (the link is cut): a reader only sets them
when its caller asked for verify or a trace.

Flags of a SEND (issue 20; a SEND without them is the 24 bytes it always was, flags
and ``ext`` 0): TX_EXT (0x01): ``ext`` bytes of extension block (peer_ext: the
sender's trace id, for the receiver's log records and its listing of the message
while it waits for a receive) follow the header, before the message.  A daemon from
before issue 20 read neither field (it would take the block for the message's first
bytes): a sender sets TX_EXT only on a link whose responder said, in its HELLO reply,
that it reads it (the ``send-ext`` feature, :mod:`.peer_handshake`).  An unknown flag,
``ext`` without TX_EXT or over MAX_EXT cannot be framed (BadFrame); a block that is
framed but wrong (a CRC32C entry: a SEND carries none) refuses the message.

``ext`` is the length of an extension block after a WRITE's page table
(:mod:`.peer_ext`: a per-part CRC32C and a trace id, issue 20); a block this daemon
cannot read refuses the frame (BAD_REQUEST; its bytes are skipped, the framing holds).
An ACK refusing a part whose checksum did not match carries the code ``INTEGRITY``
(:class:`~.errors.IntegrityError`; the initiator re-sends the part once).

A receiver never allocates for a length the sender vouches for: a header's size
comes from ``npages`` (at most :data:`MAX_PAGES`), a SEND's payload is bounded by
the caller, a WRITE's payload goes to the memory its pages name (checked first) or
is skipped.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import (
    BadFrame,
    BadRequest,
    IntegrityError,
    PeerAnswered,
    PeerUnreachable,
    TransferdError,
    error_from_body,
)
from .peer_ext import parse_ext

# The largest page list one WRITE carries (the engine puts 256 in a frame).
MAX_PAGES = 4096
# An error message longer than this is cut (an ACK stays small).
MAX_ERROR_TEXT = 4096
# The longest extension block a WRITE may announce (peer_ext's entries take 34).
MAX_EXT = 4096


class Cmd(enum.IntEnum):
    WRITE = 0x41
    ACK = 0x42
    SEND = 0x43
    # One-sided READ and its data (issue 19).
    READ = 0x46
    READ_DATA = 0x47
    SETUP = 0x4E


WRITE, ACK, SEND, SETUP = int(Cmd.WRITE), int(Cmd.ACK), int(Cmd.SEND), int(Cmd.SETUP)
READ, READ_DATA = int(Cmd.READ), int(Cmd.READ_DATA)
# The longest set-up a Domain exchanges after the handshake.
MAX_SETUP = 4096

# WRITE flags.
IMM = 0x01
SPAN = 0x02
WID = 0x04
AGAIN = 0x08
UNIFORM = 0x10
KNOWN_FLAGS = IMM | SPAN | WID | AGAIN | UNIFORM
# READ flags: answer with the payload's CRC32C; an extension block follows the table.
RX_CRC = 0x01
RX_EXT = 0x02
KNOWN_READ_FLAGS = RX_CRC | RX_EXT
# SEND flags: an extension block (the trace id) follows the header.
TX_EXT = 0x01
KNOWN_SEND_FLAGS = TX_EXT

WRITE_HEAD = struct.Struct("<BBHIQQIIQQ")
ACK_HEAD = struct.Struct("<BBHIQ")
SEND_HEAD = struct.Struct("<BBHIQQ")
SETUP_HEAD = struct.Struct("<BBHI")
SPAN_FMT = struct.Struct("<QQ")
# A one-page WRITE's header whole: the fixed part and its page (the small write).
WRITE_ONE = struct.Struct("<BBHIQQIIQQQQ")
WRITE_ONE_SPAN = struct.Struct("<BBHIQQIIQQQQQQ")
READ_HEAD = struct.Struct("<BBHIQQQ")
# A READ with RX_EXT: the fixed part and its extension block's length (and 4 zero bytes:
# the page table stays 8-byte aligned).
READ_EXT_HEAD = struct.Struct("<BBHIQQQII")
READ_DATA_HEAD = struct.Struct("<BBHIQQ")
assert READ_HEAD.size == 32 and READ_DATA_HEAD.size == 24 and READ_EXT_HEAD.size == 40
assert WRITE_HEAD.size == 48 and ACK_HEAD.size == 16 and SEND_HEAD.size == 24

_ack_ok = ACK_HEAD.pack
_U64 = (1 << 64) - 1


def write_table_len(flags: int, npages: int, ext: int) -> int:
    """Bytes after a WRITE's fixed 48 (span, page table, extension block)."""
    n = 16 + ext if flags & SPAN else ext
    return n + (8 + 8 * npages if flags & UNIFORM else 16 * npages)


@dataclass(slots=True)
class WriteHeader:
    """A WRITE's header, checked."""

    op: int
    part: int
    rkey: int
    addrs: list[int]
    lens: list[int]
    imm: int | None
    span: tuple[int, int] | None = None
    # The client's write id (a retry carries the same): applied at most once.
    wid: int | None = None
    # Re-sent on another rail after its own failed: if this very part landed
    # already, it is acknowledged and neither placed nor counted again.
    again: bool = False
    # The extension block's (peer_ext): CRC32C of the payload, the W3C trace id.
    crc: int | None = None
    trace: bytes | None = None

    @property
    def nbytes(self) -> int:
        return sum(self.lens)


def encode_write(op: int, part: int, rkey: int, addrs: list[int], lens: list[int],
                 imm: int | None, span: Sequence[int] | None = None,
                 wid: int | None = None, again: bool = False, ext: bytes = b"") -> bytes:
    """A WRITE's header (fixed part, span, page table, extension block ``ext``); the
    payload follows it."""
    flags = (IMM if imm is not None else 0) | (WID if wid is not None else 0) | \
        (AGAIN if again else 0)
    n = len(addrs)
    plen = sum(lens)
    x = len(ext)
    if n == 1:
        if span is None:
            head = WRITE_ONE.pack(WRITE, flags, 1, part, op, rkey, imm or 0, x, wid or 0, plen,
                                  addrs[0], lens[0])
        else:
            head = WRITE_ONE_SPAN.pack(WRITE, flags | SPAN, 1, part, op, rkey, imm or 0, x,
                                       wid or 0, plen, span[0], span[1], addrs[0], lens[0])
        return head + ext if x else head
    if span is not None:
        raise ValueError("a span goes with one range")
    if n > 1 and min(lens) == max(lens):
        return (WRITE_HEAD.pack(WRITE, flags | UNIFORM, n, part, op, rkey, imm or 0, x,
                                wid or 0, plen)
                + struct.pack(f"<{n + 1}Q", lens[0], *addrs) + ext)
    table = [v for pair in zip(addrs, lens, strict=True) for v in pair]
    return (WRITE_HEAD.pack(WRITE, flags, n, part, op, rkey, imm or 0, x, wid or 0,
                            plen)
            + struct.pack(f"<{2 * n}Q", *table) + ext)


def check_write_head(flags: int, npages: int, ext: int) -> None:
    """BadFrame for a header whose size cannot be trusted (the link cannot go on)."""
    if flags & ~KNOWN_FLAGS:
        # A flag unknown here could change the header's size: the framing is lost.
        raise BadFrame(f"peer WRITE: unknown flag bits 0x{flags & ~KNOWN_FLAGS:02x}")
    if npages > MAX_PAGES:
        raise BadFrame(f"peer WRITE of {npages} pages: at most {MAX_PAGES} go in a frame")
    if ext > MAX_EXT:
        raise BadFrame(f"peer WRITE with a {ext}-byte extension block (at most {MAX_EXT})")


def parse_write(buf: bytes | bytearray | memoryview, off: int, head: tuple[int, ...]
                ) -> WriteHeader:
    """The WRITE whose fixed part ``head`` (already unpacked at ``off``) and table
    (``write_table_len`` bytes after it) are in ``buf``.  BadRequest for contents
    that are wrong but framed (the frame is refused, the link goes on)."""
    _cmd, flags, n, part, op, rkey, imm, ext, wid, plen = head
    pos = off + 48
    if n == 1 and not flags & (SPAN | UNIFORM) and not ext:
        # The small write: one page, its header 64 bytes.
        a, length = SPAN_FMT.unpack_from(buf, pos)
        if length != plen:
            raise BadRequest(f"pages hold {length} bytes but the payload has {plen}")
        if a + length > _U64 + 1:
            raise BadRequest("peer WRITE: a page runs past the end of the address space")
        return WriteHeader(op, part, rkey, [a], [length], imm if flags & IMM else None, None,
                           wid if flags & WID else None, bool(flags & AGAIN))
    span: tuple[int, int] | None = None
    if flags & SPAN:
        span = SPAN_FMT.unpack_from(buf, pos)
        pos += 16
    uniform = flags & UNIFORM
    if uniform:
        length, *addrs = struct.unpack_from(f"<{n + 1}Q", buf, pos)
        lens = [length] * n
    elif n == 1:
        a, length = SPAN_FMT.unpack_from(buf, pos)
        addrs, lens = [a], [length]
    else:
        table = struct.unpack_from(f"<{2 * n}Q", buf, pos)
        addrs, lens = list(table[0::2]), list(table[1::2])
    w = WriteHeader(op, part, rkey, addrs, lens, imm if flags & IMM else None, span,
                    wid if flags & WID else None, bool(flags & AGAIN))
    if ext:
        w.crc, w.trace = parse_ext(buf, pos + (8 + 8 * n if flags & UNIFORM else 16 * n), ext)
    if span is not None:
        if n != 1:
            raise BadRequest("peer WRITE: a span goes with one range")
        a, ln = addrs[0], lens[0]
        if a < span[0] or a + ln > span[0] + span[1]:
            raise BadRequest(f"peer WRITE: range [0x{a:x}, +{ln}) is outside its span "
                             f"[0x{span[0]:x}, +{span[1]})")
    if uniform:
        # Pages of one length (a paged write): the sum and the highest end at once.
        if length * n != plen:
            raise BadRequest(f"pages hold {length * n} bytes but the payload has {plen}")
        if n and max(addrs) + length > _U64 + 1:
            raise BadRequest("peer WRITE: a page runs past the end of the address space")
        return w
    if sum(lens) != plen:
        raise BadRequest(f"pages hold {sum(lens)} bytes but the payload has {plen}")
    if addrs and max(a + ln for a, ln in zip(addrs, lens, strict=True)) > _U64 + 1:
        raise BadRequest("peer WRITE: a page runs past the end of the address space")
    return w


@dataclass(slots=True)
class ReadHeader:
    """A READ's header, checked: the responder's pages to send back, in order."""

    op: int
    part: int
    rkey: int
    addrs: list[int]
    lens: list[int]
    # RX_CRC: the answer carries the CRC32C of its payload; the reader's trace id.
    crc: bool = False
    trace: bytes | None = None

    @property
    def nbytes(self) -> int:
        return sum(self.lens)


def encode_read(op: int, part: int, rkey: int, addrs: Sequence[int],
                lens: Sequence[int], crc: bool = False, ext: bytes = b"") -> bytes:
    """A READ: its fixed 32 bytes and its page table (no payload); ``crc`` asks for the
    answer's checksum, ``ext`` an extension block (peer_ext: the trace id).  Neither:
    the frame of issue 19, byte for byte."""
    n = len(addrs)
    table = [x for pair in zip(addrs, lens, strict=True) for x in pair]
    flags = RX_CRC if crc else 0
    if ext:
        return (READ_EXT_HEAD.pack(READ, flags | RX_EXT, n, part, op, rkey, sum(lens),
                                   len(ext), 0)
                + struct.pack(f"<{2 * n}Q", *table) + ext)
    return (READ_HEAD.pack(READ, flags, n, part, op, rkey, sum(lens))
            + struct.pack(f"<{2 * n}Q", *table))


def check_read_head(flags: int, npages: int) -> None:
    """BadFrame for a READ header whose size cannot be trusted."""
    if flags & ~KNOWN_READ_FLAGS:
        raise BadFrame(f"peer READ: unknown flag bits 0x{flags & ~KNOWN_READ_FLAGS:02x}")
    if npages > MAX_PAGES:
        raise BadFrame(f"peer READ of {npages} pages: at most {MAX_PAGES} go in a frame")


def read_ext_len(buf: bytes | bytearray | memoryview, off: int) -> int:
    """The extension block's length of the RX_EXT READ at ``off`` (its 40 bytes there);
    BadFrame past MAX_EXT (the framing cannot be trusted)."""
    ext = int.from_bytes(buf[off + 32:off + 36], "little")
    if ext > MAX_EXT:
        raise BadFrame(f"peer READ with a {ext}-byte extension block (at most {MAX_EXT})")
    return ext


def read_size(buf: bytes | bytearray | memoryview, off: int, flags: int, npages: int
              ) -> int | None:
    """The whole READ's length at ``off`` (fixed part, table, extension block), or None
    while its fixed part (40 bytes with RX_EXT) is not all in ``buf``."""
    if not flags & RX_EXT:
        return 32 + 16 * npages
    if len(buf) - off < 40:
        return None
    return 40 + 16 * npages + read_ext_len(buf, off)


def parse_read(buf: bytes | bytearray | memoryview, off: int, head: tuple[int, ...]
               ) -> ReadHeader:
    """The READ whose fixed part ``head`` was unpacked at ``off`` and whose table
    (16 bytes a page) follows it in ``buf``; BadRequest for framed but wrong contents."""
    _cmd, flags, n, part, op, rkey, total = head
    pos = off + (40 if flags & RX_EXT else 32)
    table = struct.unpack_from(f"<{2 * n}Q", buf, pos)
    addrs, lens = list(table[0::2]), list(table[1::2])
    if sum(lens) != total:
        raise BadRequest(f"peer READ: pages hold {sum(lens)} bytes but it asks for {total}")
    # (The exact test page by page only when the bound of the highest address plus the
    # longest page does not already settle it: thousands of pages a paged read.)
    if addrs and max(addrs) + max(lens) > _U64 + 1 and max(
            a + ln for a, ln in zip(addrs, lens, strict=True)) > _U64 + 1:
        raise BadRequest("peer READ: a page runs past the end of the address space")
    r = ReadHeader(op, part, rkey, addrs, lens, bool(flags & RX_CRC))
    if flags & RX_EXT:
        got, r.trace = parse_ext(buf, pos + 16 * n, read_ext_len(buf, off), "READ")
        if got is not None:
            # (A checksum goes with bytes: a READ carries none, the answer does.)
            raise BadRequest("peer READ: a CRC32C entry in a READ's extension block")
    return r


def encode_read_data(op: int, part: int, nbytes: int,
                     error: TransferdError | None = None, ext: bytes = b"") -> bytes:
    """A READ_DATA's header (``nbytes`` of payload follow it) and, with ``ext``, its
    extension block (peer_ext: the payload's CRC32C); or a refusal."""
    if error is None:
        if ext:
            return READ_DATA_HEAD.pack(READ_DATA, 0, len(ext), part, op, nbytes) + ext
        return READ_DATA_HEAD.pack(READ_DATA, 0, 0, part, op, nbytes)
    text = (error.code.value + "\0" + error.message).encode("utf-8", "replace")
    text = text[:MAX_ERROR_TEXT]
    return READ_DATA_HEAD.pack(READ_DATA, 1, len(text), part, op, 0) + text


def frame_size(data: bytes | bytearray | memoryview) -> int | None:
    """The length of the data-phase frame at the start of ``data`` (header, table and
    payload), or None until its header is there; BadFrame for an unknown command."""
    if not data:
        return None
    cmd = data[0]
    if cmd == WRITE:
        if len(data) < 48:
            return None
        head = WRITE_HEAD.unpack_from(data)
        check_write_head(head[1], head[2], head[7])
        return 48 + write_table_len(head[1], head[2], head[7]) + head[9]
    if cmd == ACK:
        return None if len(data) < 16 else 16 + ACK_HEAD.unpack_from(data)[2]
    if cmd == SEND:
        if len(data) < 24:
            return None
        _, flags, ext, _, _, plen = SEND_HEAD.unpack_from(data)
        check_send_head(flags, ext)
        return 24 + ext + plen
    if cmd == SETUP:
        return None if len(data) < 8 else 8 + SETUP_HEAD.unpack_from(data)[3]
    if cmd == READ:
        if len(data) < 32:
            return None
        head = READ_HEAD.unpack_from(data)
        check_read_head(head[1], head[2])
        return read_size(data, 0, head[1], head[2])
    if cmd == READ_DATA:
        if len(data) < 24:
            return None
        _, _, mlen, _, _, plen = READ_DATA_HEAD.unpack_from(data)
        return 24 + mlen + plen
    raise BadFrame(f"peer frame 0x{cmd:02x}: not a WRITE, an ACK, a SEND or a READ")


def encode_ack(op: int, part: int, error: TransferdError | None = None) -> bytes:
    """An ACK: 16 bytes, or with an error its code and message after them."""
    if error is None:
        return _ack_ok(ACK, 0, 0, part, op)
    code = error.peer_code if isinstance(error, IntegrityError) else error.code.value
    text = (code + "\0" + error.message).encode("utf-8", "replace")
    text = text[:MAX_ERROR_TEXT]
    return ACK_HEAD.pack(ACK, 1, len(text), part, op) + text


def ack_error(status: int, text: bytes | bytearray | memoryview) -> TransferdError | None:
    """The error an ACK carries (None for ok)."""
    if status == 0:
        return None
    code, _, message = bytes(text).decode("utf-8", "replace").partition("\0")
    if code == IntegrityError.peer_code:
        return IntegrityError(message)
    err = error_from_body({"code": code or "INTERNAL", "message": message})
    # (Said by the peer on a live link: its answer, not our link failing.)
    return PeerAnswered(err.message) if type(err) is PeerUnreachable else err


def encode_send(op: int, part: int, length: int, ext: bytes = b"") -> bytes:
    """A SEND's header and, with ``ext``, its extension block (TX_EXT: peer_ext, the
    trace id); the message follows it.  Without ``ext``: the frame of before, byte for
    byte."""
    if ext:
        return SEND_HEAD.pack(SEND, TX_EXT, len(ext), part, op, length) + ext
    return SEND_HEAD.pack(SEND, 0, 0, part, op, length)


def check_send_head(flags: int, ext: int) -> None:
    """BadFrame for a SEND header whose size cannot be trusted (the link cannot go on)."""
    if flags & ~KNOWN_SEND_FLAGS:
        raise BadFrame(f"peer SEND: unknown flag bits 0x{flags & ~KNOWN_SEND_FLAGS:02x}")
    if ext and not flags & TX_EXT:
        raise BadFrame(f"peer SEND: an extension block of {ext} bytes without TX_EXT")
    if ext > MAX_EXT:
        raise BadFrame(f"peer SEND with a {ext}-byte extension block (at most {MAX_EXT})")


def parse_send_ext(buf: bytes | bytearray | memoryview, pos: int, n: int) -> bytes | None:
    """The trace id of a SEND's ``n``-byte extension block at ``pos`` (None for none);
    BadRequest for a block that is framed but wrong (the message is refused)."""
    got, trace = parse_ext(buf, pos, n, "SEND")
    if got is not None:
        raise BadRequest("peer SEND: a CRC32C entry in a SEND's extension block")
    return trace


def encode_setup(blob: bytes | None, error: TransferdError | None = None) -> bytes:
    """A SETUP frame: a Domain's set-up, or the error that refused the other's."""
    if error is not None:
        blob = (error.code.value + "\0" + error.message).encode("utf-8", "replace")[
            :MAX_SETUP]
    assert blob is not None and len(blob) <= MAX_SETUP
    return SETUP_HEAD.pack(SETUP, 1 if error is not None else 0, 0, len(blob)) + blob


def parse_message(msg: bytes | bytearray | memoryview
                  ) -> tuple[int, int, int, memoryview | None, TransferdError | None,
                             bytes | None]:
    """A SEND or an ACK that came whole in one message (a message transport):
    (cmd, op, part, the SEND's payload, the ACK's error, the SEND's trace id).  A SEND
    whose extension block is framed but wrong comes back without its payload, its
    refusal in the error's place (the message is refused, the link goes on); BadFrame
    unless the message is exactly that one frame."""
    view = memoryview(msg).cast("B")
    n = len(view)
    cmd = view[0] if n else 0
    if cmd == SEND and n >= 24:
        _, flags, ext, part, op, plen = SEND_HEAD.unpack_from(view)
        check_send_head(flags, ext)
        if 24 + ext + plen == n:
            if not ext:
                return SEND, op, part, view[24:], None, None
            try:
                trace = parse_send_ext(view, 24, ext)
            except BadRequest as exc:
                return SEND, op, part, None, exc, None
            return SEND, op, part, view[24 + ext:], None, trace
    elif cmd == ACK and n >= 16:
        _, status, mlen, part, op = ACK_HEAD.unpack_from(view)
        if 16 + mlen == n and (status or not mlen):
            return ACK, op, part, None, ack_error(status, view[16:]), None
    raise BadFrame(f"a message of {n} bytes is not one SEND or ACK frame")


__all__ = [
    "ACK",
    "ACK_HEAD",
    "AGAIN",
    "IMM",
    "MAX_PAGES",
    "READ",
    "READ_DATA",
    "READ_DATA_HEAD",
    "READ_EXT_HEAD",
    "READ_HEAD",
    "RX_CRC",
    "RX_EXT",
    "SEND",
    "SEND_HEAD",
    "SETUP",
    "SPAN",
    "TX_EXT",
    "UNIFORM",
    "WID",
    "WRITE",
    "WRITE_HEAD",
    "Cmd",
    "ReadHeader",
    "WriteHeader",
    "ack_error",
    "check_read_head",
    "check_send_head",
    "check_write_head",
    "encode_ack",
    "encode_read",
    "encode_read_data",
    "encode_send",
    "encode_setup",
    "encode_write",
    "frame_size",
    "parse_message",
    "parse_read",
    "parse_send_ext",
    "parse_write",
    "read_ext_len",
    "read_size",
    "write_table_len",
]
