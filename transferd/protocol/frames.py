"""Frame encoding and a sans-IO frame decoder.

The decoder never touches a socket.  An I/O layer (an ``asyncio.BufferedProtocol``
in practice) asks it where the next bytes should land with :meth:`get_buffer`,
reports how many arrived with :meth:`buffer_updated`, and pulls complete frames
with :meth:`next_frame`.  Payload bytes land where the consumer says: when a
frame's body has been parsed, the decoder calls the ``payload_sink`` callback,
which may return the destination memory (one or more memoryviews, e.g. the
tensors of a SET_TENSORS), so bulk data goes straight from the kernel into its
target with no intermediate ``bytes`` object.

Frames are handed out one at a time, and the sink for frame N+1 is only asked
for after frame N was returned: a consumer that executes each frame before
pulling the next can never have a later payload overwrite memory an earlier
command still has to read.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, NamedTuple

import msgpack

from transferd.copies import COUNTING, count

from .constants import (
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_PAYLOAD,
    HEADER_SIZE,
    KNOWN_FLAGS,
    MAGIC,
    Flag,
)
from .errors import BadFrame, OverLimit, TooLarge, TransferdError

HEADER = struct.Struct("<2sBBIIIQ")
assert HEADER.size == HEADER_SIZE
_unpack_header = HEADER.unpack_from
_unpackb = msgpack.unpackb

# Bytes of header and body are collected in a reusable buffer of this size;
# payloads of at least STREAM_THRESHOLD bytes bypass it and are read straight
# into their sink.
READ_CHUNK = 256 * 1024
STREAM_THRESHOLD = 64 * 1024
# The largest batch body a server's decoder remembers for a repeat (FrameDecoder._repeats):
# a decode step's batch of a few hundred tensors, and a bound on what a connection keeps
# between frames (the bytes, and a decoded list of at most REPEAT_BODY // 4 tensors).
REPEAT_BODY = 4096

_packer = msgpack.Packer(use_bin_type=True)


class Discard:
    """Sink marker: read the payload and throw it away (a rejected request)."""


DISCARD = Discard()

# A sink is the memory the payload goes to: memoryviews filled in order whose
# lengths add up to payload_len; DISCARD; or None for "collect into a bytearray".
Sink = Sequence[memoryview] | Discard | None
SinkFactory = Callable[["Frame"], Sink]


# Plain ints for the hot path: IntFlag's operators run Python code per call.
_REPLY = int(Flag.REPLY)
_ERROR = int(Flag.ERROR)
_EVENT = int(Flag.EVENT)
_NO_REPLY = int(Flag.NO_REPLY)


@dataclass(slots=True)
class Frame:
    cmd: int
    flags: int  # Flag bits; a plain int when decoded (compares equal to Flag values)
    seq: int
    body: dict[str, Any]
    payload_len: int = 0
    body_len: int = 0
    # Set only when the payload was collected by the decoder (sink None).
    payload: bytearray | None = None
    # True when the payload went to a DISCARD sink.
    discarded: bool = False
    # Set by the decoder when the body broke a per-command cap (array_caps): the
    # frame is whole and framing goes on; the request gets this error.
    refused: TransferdError | None = None

    @property
    def wire_len(self) -> int:
        return HEADER_SIZE + self.body_len + self.payload_len

    @property
    def is_reply(self) -> bool:
        return bool(int(self.flags) & _REPLY)

    @property
    def is_error(self) -> bool:
        return bool(int(self.flags) & _ERROR)

    @property
    def is_event(self) -> bool:
        return bool(int(self.flags) & _EVENT)

    @property
    def no_reply(self) -> bool:
        return bool(int(self.flags) & _NO_REPLY)


def pack_body(body: dict[str, Any] | None) -> bytes:
    """msgpack a body; an empty or missing body is zero bytes on the wire."""
    if not body:
        return b""
    return _packer.pack(body)


_pack_header = HEADER.pack
_pack = _packer.pack


def encode_head(cmd: int, flags: int, seq: int, body: dict[str, Any] | bytes | None,
                payload_len: int) -> bytes:
    """The one frame encoder: header and msgpack body as one bytes; the caller sends
    ``payload_len`` payload bytes after it.  Every frame the client and the server
    write is made here (the sans-IO connections call it); nothing else packs a header.
    A body given as ``bytes`` was packed already (:func:`pack_body`: the client keeps a
    batch's packed tensor list for the next step that sends the same tensors)."""
    raw = body if type(body) is bytes else _pack(body) if body else b""
    return _pack_header(MAGIC, cmd, flags, seq & 0xFFFFFFFF, len(raw), 0, payload_len) + raw


def encode_header(cmd: int, flags: int, seq: int, body_len: int, payload_len: int) -> bytes:
    """A header alone (for tests that lie about the body that follows)."""
    return _pack_header(MAGIC, cmd, int(flags), seq & 0xFFFFFFFF, body_len, 0, payload_len)


def encode_frame(
    cmd: int,
    flags: int = 0,
    seq: int = 0,
    body: dict[str, Any] | None = None,
    payload_len: int = 0,
) -> bytes:
    """Header and body (:func:`encode_head` with defaults)."""
    return encode_head(cmd, int(flags), seq, body, payload_len)


class RawHeader(NamedTuple):
    """The seven header fields as unpacked (a tuple: built without a Python call)."""

    magic: bytes
    cmd: int
    flags: int
    seq: int
    body_len: int
    reserved: int
    payload_len: int


def decode_header(data: bytes | bytearray | memoryview) -> RawHeader:
    """Unpack 24 bytes without judging them (see :func:`check_header`)."""
    return _new_header(RawHeader, HEADER.unpack_from(data))


_new_header = tuple.__new__
# Any bit outside KNOWN_FLAGS (the field is one byte).
_UNKNOWN_FLAGS = 0xFF & ~int(KNOWN_FLAGS)


def check_header(h: RawHeader, max_body: int, max_payload: int) -> None:
    if h.magic != MAGIC:
        raise BadFrame(f"bad magic {h.magic!r}, expected {MAGIC!r}", seq=h.seq)
    if h.reserved != 0:
        raise BadFrame(f"reserved field is {h.reserved}, must be 0", seq=h.seq)
    if h.flags & ~int(KNOWN_FLAGS):
        raise BadFrame(f"unknown flag bits 0x{h.flags:02x}", seq=h.seq)
    if h.body_len > max_body:
        raise TooLarge(f"body of {h.body_len} bytes is over the limit of {max_body}", seq=h.seq)
    if h.payload_len > max_payload:
        raise TooLarge(
            f"payload of {h.payload_len} bytes is over the limit of {max_payload}", seq=h.seq
        )


def unpack_body(raw: bytes | bytearray | memoryview, seq: int) -> dict[str, Any]:
    if len(raw) == 0:
        return {}
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        # Some say nothing (StackError: nested deeper than msgpack's stack): name them.
        why = str(exc) or ("nested too deep" if isinstance(exc, msgpack.StackError)
                           else type(exc).__name__)
        raise BadFrame(f"body is not valid msgpack: {why}", seq=seq) from None
    if not isinstance(body, dict):
        raise BadFrame("body must be a msgpack map with string keys", seq=seq)
    for k in body:
        if not isinstance(k, str):
            raise BadFrame("body must be a msgpack map with string keys", seq=seq)
    return body


class Phase(enum.Enum):
    HEADER = "header"
    BODY = "body"
    PAYLOAD = "payload"
    BROKEN = "broken"


# Module-level aliases: in Python 3.11 every ``Phase.X`` goes through
# EnumType.__getattr__, ten times slower than a global, on every frame.
_HEADER = Phase.HEADER
_BODY = Phase.BODY
_PAYLOAD = Phase.PAYLOAD
_BROKEN = Phase.BROKEN


class FrameDecoder:
    """Bytes in, frames out.  See the module docstring for the calling pattern."""

    def __init__(
        self,
        *,
        max_body: int = DEFAULT_MAX_BODY,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        payload_sink: SinkFactory | None = None,
        exact: bool = False,
        buffer_size: int = READ_CHUNK,
    ) -> None:
        # exact: never ask for bytes past the current frame, so every payload
        # byte is received straight into its sink (the peer plane's mode; the
        # price is a receive per header and per body).
        self.exact = exact
        self.max_body = max_body
        self.max_payload = max_payload
        self._sink_factory = payload_sink
        # A connection that has not authenticated gets a small buffer
        # (buffer_size); grow_buffer() gives it READ_CHUNK once it has.
        self._buf = bytearray(buffer_size)
        self._view = memoryview(self._buf)
        self._start = 0  # first unconsumed byte in _buf
        self._end = 0  # one past the last received byte in _buf
        self.phase = _HEADER
        self._header: RawHeader | None = None
        self._frame: Frame | None = None
        # Payload state: the sink segments, which one we are in, how far.
        self._segments: list[memoryview] = []
        self._seg_index = 0
        self._seg_pos = 0
        self._payload_left = 0
        self._discard = False
        self._direct = False  # get_buffer handed out sink memory
        # Called with every header before the limits are checked, while set
        # (the pre-auth rules of a server connection); raises to refuse it.
        self.gate: Callable[[RawHeader], None] | None = None
        # Per command: the longest list its body may hold. msgpack refuses a longer
        # one at its length prefix, before building a single element, so a batch
        # over its cap costs no decoding (a 650,000-tensor body held the loop 0.2 s).
        self.array_caps: dict[int, int] = {}
        # Per capped command, the last body decoded: (its bytes, its cap, the body).  A
        # batch that repeats its command's last one byte for byte (a decode loop's step)
        # is that body again, not unpacked again; its list is the same object, so the
        # handler's check of it can be reused too (rpc_server/handlers.batch_views).
        self._repeats: dict[int, tuple[bytes, int, dict[str, Any]]] = {}
        # Elastic (a server's connection once it authenticated, :meth:`elastic`): the
        # size the buffer goes back to once all it received is consumed after a receive
        # that did not fill it (0: it keeps the size it grew to). Where the last receive
        # began (_mark) and how much room it was offered (_offered; 0: none judged).
        self._small = 0
        self._mark = 0
        self._offered = 0

    def elastic(self, small: int) -> None:
        """From now on the buffer is READ_CHUNK only while bytes come faster than one
        receive takes (a receive filled it), or a body needs more, and ``small`` again
        once it is empty after a receive that left room: what a quiet connection holds
        is ``small``, whatever it received before. (Grown at authentication and to its
        largest body for good, 2,000 idle connections held 514 MiB of a daemon, 100 that
        each sent one 4 MiB body 407 MiB.)"""
        self._small = small
        if len(self._buf) > small and self._start == self._end and self.phase is _HEADER:
            self._resize(small)

    def _quiet(self) -> None:
        """Nothing buffered at a frame boundary (elastic): back to the small size if the
        last receive left room (no more was waiting in the socket)."""
        if self._end - self._mark < self._offered and len(self._buf) > self._small:
            self._resize(self._small)
            self._offered = 0

    # -- the I/O side ---------------------------------------------------------

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes should be written."""
        phase = self.phase
        if phase is _BROKEN:
            raise BadFrame("decoder is closed after a protocol error")
        if phase is _PAYLOAD and self._goes_direct():
            seg = self._segments[self._seg_index]
            self._direct = True
            self._offered = 0
            return seg[self._seg_pos :]
        self._direct = False
        # Elastic, and the last receive filled all it was offered: more is waiting, take
        # it in large pieces (the live bytes move with it).
        if self._small and self._offered and self._end - self._mark >= self._offered \
                and len(self._buf) < READ_CHUNK:
            self._resize(READ_CHUNK)
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._end < 4096 or self._start > len(self._buf) // 2:
            self._compact()
        if self.exact:
            return self._view[self._end : self._end + self._wanted()]
        if self._small:
            self._mark = self._end
            self._offered = len(self._buf) - self._end
        return self._view[self._end :]

    def get_buffers(self, max_iov: int = 64, max_bytes: int = 1 << 62) -> list[memoryview]:
        """Like get_buffer, but a payload's remaining sink segments at once.

        For ``recvmsg_into``: one receive scatters straight over a page list.
        At most ``max_iov`` segments and about ``max_bytes`` bytes are offered.
        """
        if not self._goes_direct():
            return [self.get_buffer()]
        self._direct = True
        segs = self._segments
        i = self._seg_index
        first = segs[i][self._seg_pos :]
        out = [first]
        total = len(first)
        for seg in islice(segs, i + 1, i + max_iov):
            if total >= max_bytes:
                break
            out.append(seg)
            total += len(seg)
        return out

    def _goes_direct(self) -> bool:
        # Straight into the sink only where the piece it lands in is large: a payload
        # of many small tensors is received into the buffer and copied (a receive per
        # small tensor would cost a system call each).
        return (
            self.phase is _PAYLOAD
            and not self._discard
            and self._start == self._end
            and (self.exact or len(self._segments[self._seg_index]) - self._seg_pos
                 >= STREAM_THRESHOLD)
        )

    def _wanted(self) -> int:
        """Bytes still missing from the current frame part (exact mode)."""
        have = self._end - self._start
        if self.phase is _HEADER:
            return HEADER_SIZE - have
        if self.phase is _BODY:
            assert self._header is not None
            return self._header.body_len - have
        return min(self._payload_left - have, len(self._buf) - self._end)

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written into the memory the last get_buffer returned."""
        if self._direct:
            self._direct = False
            self._advance_payload(nbytes)
        else:
            self._end += nbytes

    @property
    def current_cmd(self) -> int:
        """The cmd of the frame being decoded, or of the one that broke the stream."""
        return self._header.cmd if self._header is not None else 0

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Copying convenience for tests and simple callers: feed bytes, get frames."""
        frames: list[Frame] = []
        src = memoryview(data).cast("B")
        while True:
            frame = self.next_frame()
            while frame is not None:
                frames.append(frame)
                frame = self.next_frame()
            if not len(src):
                return frames
            dst = self.get_buffer(len(src))
            n = min(len(dst), len(src))
            dst[:n] = src[:n]
            src = src[n:]
            self.buffer_updated(n)

    # -- the consumer side ----------------------------------------------------

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None until more bytes arrive.

        Raises a ProtocolError (BadFrame or TooLarge, with the offending
        frame's seq) when the stream is broken; the decoder is unusable after.
        """
        if self._start == self._end and self.phase is _HEADER:
            if self._small:
                self._quiet()
            return None  # the common "nothing more buffered" answer, without a turn
        try:
            # One turn of the loop per phase, except that a header whose body has
            # already arrived (the usual case) is parsed together with it.
            while True:
                phase = self.phase
                start = self._start
                avail = self._end - start
                if phase is _HEADER:
                    if avail < HEADER_SIZE:
                        if not avail and self._small:
                            self._quiet()
                        return None
                    h = _new_header(RawHeader, _unpack_header(self._buf, start))
                    # Kept before judging it, so an error can name the frame's cmd.
                    self._header = h
                    if self.gate is not None:
                        self.gate(h)
                    if (
                        h.magic != MAGIC
                        or h.reserved
                        or h.flags & _UNKNOWN_FLAGS
                        or h.body_len > self.max_body
                        or h.payload_len > self.max_payload
                    ):
                        # One of the checks failed: let check_header say which.
                        check_header(h, self.max_body, self.max_payload)
                    start += HEADER_SIZE
                    self._start = start
                    body_len = h.body_len
                    if HEADER_SIZE + body_len > len(self._buf):
                        self.phase = _BODY
                        self._grow(body_len)
                        continue
                    if avail - HEADER_SIZE < body_len:
                        self.phase = _BODY
                        return None
                elif phase is _BODY:
                    hb = self._header
                    assert hb is not None
                    h = hb
                    body_len = h.body_len
                    if avail < body_len:
                        if HEADER_SIZE + body_len > len(self._buf) \
                                and len(self._buf) - self._end < READ_CHUNK:
                            self._grow(body_len)  # the bytes came: room for more of them
                        return None
                elif phase is _PAYLOAD:
                    if avail:
                        n = min(avail, self._payload_left)
                        self._copy_into_payload(self._view[start : start + n])
                        self._start = start + n
                    if self._payload_left == 0:
                        done = self._frame
                        assert done is not None
                        self._frame = None
                        self._segments = []
                        self.phase = _HEADER
                        return done
                    return None
                else:
                    raise BadFrame("decoder is closed after a protocol error")
                # A whole header and body: the frame, or the start of its payload.
                refused: TransferdError | None = None
                if body_len:  # unpack_body(), inlined for a well-formed body
                    raw = self._view[start : start + body_len]
                    cap = self.array_caps.get(h.cmd) if self.array_caps else None
                    key = b""
                    last = None
                    if cap is not None and body_len <= REPEAT_BODY:
                        key = bytes(raw)
                        last = self._repeats.get(h.cmd)
                        if last is not None and (last[0] != key or last[1] != cap):
                            last = None
                    body: Any
                    if last is not None:
                        # Byte for byte the last body: already unpacked and judged (a
                        # dict with string keys, lists within the cap).  A new dict; its
                        # values are the same objects (nothing that reads a request's
                        # body changes it).
                        body = dict(last[2])
                    else:
                        try:
                            if cap is None:
                                body = _unpackb(raw, raw=False, strict_map_key=True)
                            else:
                                body = _unpackb(raw, raw=False, strict_map_key=True,
                                                max_array_len=cap)
                        except ValueError as exc:
                            body = None
                            if cap is not None and "exceeds max_array_len" in str(exc):
                                body = {}
                                refused = OverLimit(
                                    f"a list of more than {cap} entries in this request's "
                                    f"body is over this server's cap for it (max_tensors = "
                                    f"{cap}, announced in HELLO): split it", seq=h.seq)
                        except Exception:
                            body = None
                        ok = type(body) is dict
                        if ok:
                            for k in body:
                                if type(k) is not str:
                                    ok = False
                        if not ok:
                            body = unpack_body(raw, h.seq)  # raises the right BadFrame
                        if key and cap is not None and refused is None:
                            self._repeats[h.cmd] = (key, cap, body)
                else:
                    body = {}
                self._start = start + body_len
                frame = Frame(h.cmd, h.flags, h.seq, body, h.payload_len, body_len)
                if refused is not None:
                    frame.refused = refused
                plen = h.payload_len
                if plen == 0:
                    self.phase = _HEADER
                    return frame
                if self._end - self._start >= plen:
                    # The whole payload came with its header (a small reply): one copy
                    # where it is collected, without the payload phase's turns.
                    sink = self._sink_factory(frame) if self._sink_factory is not None \
                        else None
                    if sink is None:
                        start = self._start
                        if COUNTING:
                            count("decoder.payload", plen)
                        frame.payload = bytearray(self._view[start : start + plen])
                        self._start = start + plen
                        self.phase = _HEADER
                        return frame
                    self._begin_payload(frame, sink)
                else:
                    self._begin_payload(frame)
        except Exception:
            self.phase = _BROKEN
            raise

    # -- internals ------------------------------------------------------------

    def _begin_payload(self, frame: Frame, sink: Sink = None) -> None:
        if sink is None and self._sink_factory is not None:
            sink = self._sink_factory(frame)
        self._frame = frame
        self._payload_left = frame.payload_len
        self._seg_index = 0
        self._seg_pos = 0
        self._discard = isinstance(sink, Discard)
        if self._discard:
            frame.discarded = True
            self._segments = []
        elif sink is None:
            frame.payload = bytearray(frame.payload_len)
            self._segments = [memoryview(frame.payload)]
        else:
            assert not isinstance(sink, Discard)
            if len(sink) == 1:  # one tensor, the usual reply to a GET_TENSOR
                seg = sink[0] if sink[0].format == "B" else memoryview(sink[0]).cast("B")
                if len(seg) == frame.payload_len:  # else the general path reports it
                    self._segments = [seg]
                    self.phase = _PAYLOAD
                    return
            segs = [s if s.format == "B" else memoryview(s).cast("B") for s in sink]
            lens = list(map(len, segs))
            total = sum(lens)
            if total != frame.payload_len:
                # Our own sinks always match; a peer whose payload does not fit
                # what its request set up is breaking the protocol.
                raise BadFrame(
                    f"payload of {frame.payload_len} bytes where {total} were expected",
                    seq=frame.seq,
                )
            self._segments = [s for s in segs if len(s)] if 0 in lens else segs
        self.phase = _PAYLOAD

    def _copy_into_payload(self, data: memoryview) -> None:
        if self._discard:
            self._payload_left -= len(data)
            return
        if COUNTING:
            count("decoder.payload", len(data))
        # One pass over the segments (a batch's many small tensors); the same
        # bookkeeping as _advance_payload, inlined (segments are never empty).
        segs = self._segments
        i = self._seg_index
        off = self._seg_pos
        pos = 0
        total = len(data)
        if off == 0 and total == self._payload_left:
            # The rest of the payload, from a segment's start: fill them all.
            for seg in segs[i:] if i else segs:
                n = len(seg)
                seg[:] = data[pos : pos + n]
                pos += n
            self._seg_index = len(segs)
            self._payload_left = 0
            return
        while pos < total:
            seg = segs[i]
            seg_len = len(seg)
            n = min(seg_len - off, total - pos)
            seg[off : off + n] = data[pos : pos + n]
            pos += n
            off += n
            if off == seg_len:
                i += 1
                off = 0
        self._seg_index = i
        self._seg_pos = off
        self._payload_left -= total

    def _advance_payload(self, n: int) -> None:
        self._payload_left -= n
        if self._discard:
            return
        self._seg_pos += n
        while self._seg_index < len(self._segments) and self._seg_pos >= len(
            self._segments[self._seg_index]
        ):
            self._seg_pos -= len(self._segments[self._seg_index])
            self._seg_index += 1

    def _compact(self) -> None:
        live = self._end - self._start
        if COUNTING:
            count("decoder.compact", live)
        self._view[:live] = self._view[self._start : self._end]
        self._start, self._end = 0, live

    def grow_buffer(self, size: int = READ_CHUNK) -> None:
        """Make the buffer at least ``size`` bytes (after authentication)."""
        if len(self._buf) < size:
            self._resize(size)

    def _grow(self, body_len: int) -> None:
        # Only for a body within max_body (checked above): before
        # authentication that is at most 4096 bytes, inside the small buffer.  Never
        # to the length a header claims at once (a client takes any max_body its
        # server announces): at most twice the buffer each time, as its bytes come.
        self._resize(max(READ_CHUNK, min(body_len + READ_CHUNK, 2 * len(self._buf))))

    def _resize(self, size: int) -> None:
        live = bytes(self._view[self._start : self._end])
        if COUNTING:
            count("decoder.resize", 2 * len(live))
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._buf[: len(live)] = live
        self._start, self._end = 0, len(live)
