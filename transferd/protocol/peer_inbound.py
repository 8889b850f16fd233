"""The end of a peer link a peer dialled, sans-IO (see :mod:`.peer_link`).

It runs the handshake as responder, then every WRITE is claimed, checked and landed or
failed by the group's :class:`~.peer_landing.Landing` and acknowledged, every SEND handed
on as a :class:`~.peer_link.Deliver` event and acknowledged when the I/O side says a
client has it, every READ checked by the same Landing and answered with a READ_DATA
whose payload is views of the region (held, admitted, until the socket took them).
It reads only what the frame in hand needs, so that a payload is received
straight into its pages; it holds (PAUSED) while its ACKs go unread or a landing into
device memory is in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice, pairwise
from operator import sub
from typing import Any

from transferd.copies import COUNTING, count

from . import crc
from .errors import BadFrame, BadRequest, IntegrityError, TransferdError
from .keyring import Keyring
from .peer_ext import encode_ext
from .peer_handshake import SEND_EXT, PeerHandshake, PeerIdentity, Role
from .peer_landing import Admission, Landing, Placement, Source
from .peer_link import (
    ACK_HIGH,
    ACK_LOW,
    HEAD_GUESS,
    IOV_MAX,
    READ_HIGH,
    READ_LOW,
    RECV_BYTES,
    Deliver,
    Incoming,
    Land,
    LinkEnd,
    LinkInput,
    LinkState,
    Peer,
    Placed,
    ReadsServed,
    Refused,
    StageRead,
    scatter_into,
)
from .peer_wire import (
    KNOWN_FLAGS,
    MAX_EXT,
    MAX_PAGES,
    READ,
    READ_HEAD,
    RX_EXT,
    SEND,
    SEND_HEAD,
    WRITE,
    WRITE_HEAD,
    ReadHeader,
    check_read_head,
    check_send_head,
    check_write_head,
    encode_ack,
    encode_read_data,
    parse_read,
    parse_send_ext,
    parse_write,
    read_ext_len,
    write_table_len,
)

# The longest extension block the frame-start read grows to take in (a checksum and
# a trace id are 34 bytes).
MAX_GUESS_EXT = 64
# The longest WRITE header (fixed part, page table, extension block) the frame-start
# read grows to take in whole: a paged write's of up to 256 pages of one length (the
# engine's frames), so that its header comes in one receive and its pages in the next.
# What a shorter frame brings in beyond its header is payload, copied from the buffer
# to its pages: at most this much a frame.
MAX_GUESS_TABLE = 48 + 8 + 8 * 256 + MAX_GUESS_EXT
# A frame's start is read with this much room past the header guessed: a small write's
# header and payload (4 KiB) in one receive, not two (a receive costs more than
# copying a page out of the buffer into its region).
SMALL_PAYLOAD = 16 * 1024
# Checksum mismatches in a row after which an inbound link is closed.
MISMATCH_CUTOFF = 4


def _disjoint(addrs: list[int], lens: list[int]) -> bool:
    """No two pages share a byte (each a range of the one region ``addrs`` are in)."""
    if min(lens) == max(lens):  # (a paged write's: about 20 us for 256 pages here)
        s = sorted(addrs)
        return not lens[0] or min(map(sub, s[1:], s)) >= lens[0]
    pages = sorted((a, n) for a, n in zip(addrs, lens, strict=True) if n)
    return all(a + n <= b for (a, n), (b, _) in pairwise(pages))


class InboundLink(LinkEnd):
    """The end of a link a peer dialled (see the module docstring).

    ``landing`` holds the group's rules; ``abort`` (from any thread) is what the I/O
    side does when a region is deregistered while one of this link's writes is
    landing in it (close the link: no more of it lands).  ``max_message`` bounds a
    SEND's payload (collected in memory: refused before anything is allocated).
    ``stream_frames``: False for a link whose stream carries only the handshake and
    the set-up (verbs: writes and messages go by the NIC), where any other frame on
    it is BadFrame.
    """

    def __init__(self, me: PeerIdentity, rail: int, secret: bytes | Keyring | None, now: float, *,
                 landing: Landing, timeout: float, max_message: int,
                 admit: Callable[[PeerIdentity], None] | None = None,
                 abort: Callable[[], None] | None = None, stream_frames: bool = True,
                 random: Callable[[int], bytes] | None = None) -> None:
        kw: dict[str, Any] = {} if random is None else {"random": random}
        # A SEND's extension block is read here on a link that carries frames, and by
        # peer_wire.parse_message where a verbs rail's messages come whole: its HELLO
        # reply says so.
        super().__init__(PeerHandshake(Role.RESPONDER, me, rail, secret, now, timeout=timeout,
                                       admit=admit, features=(SEND_EXT,), **kw))
        self.rail = rail
        self.stream_frames = stream_frames
        self.landing = landing
        self.max_message = max_message
        self._abort = abort
        self._key: Peer = (0, 0)
        # The frame whose payload is being received: what it is, where it goes.
        self._kind = 0
        self._ref = (0, 0)
        self._adm: Admission | None = None
        self._refusal: TransferdError | None = None
        self._msg: bytearray | None = None
        self._trace: bytes | None = None  # the SEND in hand's (TX_EXT)
        self._nbytes = 0
        self._left = 0
        self._segs: Sequence[memoryview] = ()
        self._seg = 0
        self._pos = 0
        self._drop = False  # the payload is read and dropped (refused, or a duplicate)
        # A SEND's payload is collected as it comes (the memory it takes grows with the
        # bytes received, never to the length its header names before they are here).
        self._collect = False
        self._direct = False
        # A checksummed WRITE's CRC32C so far, over its payload bytes in the order they
        # were placed (each receive's, while they are in cache: never a second pass
        # over the part from memory); None when the frame in hand has no checksum.
        self._crc: int | None = None
        self._crc_fn: crc.CrcFn | None = None
        # How much a frame's start is read as: HEAD_GUESS, or more once this link's
        # writes carry an extension block (checksum, trace id: one read, not two).
        self._guess = HEAD_GUESS
        self._want = HEAD_GUESS  # bytes to read next (a header's)
        self._head = memoryview(b"")  # where a frame starts: _guess + SMALL_PAYLOAD bytes
        # Checksum mismatches in a row on this link (MISMATCH_CUTOFF cuts it off).
        self.mismatches = 0
        # The clock as last fed, and when the frame in hand was opened (inflight).
        self._now = now
        self._opened = now
        # Reasons to read nothing now: ACKs unread, device landings in flight.
        self._holds = 0
        self._ack_held = False
        # READs answered and not yet sent whole: (where in the output their payload
        # ends, counted in bytes ever pushed, and the memory held until then; then for
        # what is in flight: the READ's (op, part), its bytes, trace id, when it came).
        self._serving: deque[tuple[int, Placement, tuple[int, int], int, bytes | None,
                                   float]] = deque()
        self._sent_total = 0
        self._served_any = False
        self._read_held = False
        # READs whose memory side is not ready yet (device memory: its bytes on their
        # way to staging; a long checksum being taken): abandoned if the link closes.
        self._staging: list[Source] = []
        #: A write landed here met an expectation: the I/O side sends the ACKs after
        #: this turn's callbacks (the receiver's client hears first), and clears it.
        self.acks_later = False

    @property
    def reading(self) -> bool:
        """False while the link reads nothing (PAUSED, or closed)."""
        return self.state is not LinkState.PAUSED and self.state is not LinkState.CLOSED

    @property
    def in_frame(self) -> bool:
        return self._kind != 0

    @property
    def staging(self) -> bool:
        """A READ waits for its memory side (its staging copy, its checksum): the link
        reads nothing, and the I/O side should watch for the peer hanging up meanwhile
        (:meth:`close`: what waits is abandoned, not answered for nobody)."""
        return bool(self._staging)

    # -- receiving ----------------------------------------------------------------------

    def get_buffers(self) -> list[memoryview]:
        if self._buf is None:
            return super().get_buffers()
        start = self._start
        if start == self._end:
            if self._kind:
                if not self._drop and not self._collect:
                    # Straight into the pages: the rest of this payload, a socket's worth,
                    # and when that is all of it, the next frame's header into the
                    # buffer (headers go there anyway): one receive a frame while they
                    # come back to back, and a short one says the socket is empty.
                    self._direct = True
                    self._start = self._end = 0
                    segs, i, pos = self._segs, self._seg, self._pos
                    seg = segs[i]
                    if len(seg) - pos > RECV_BYTES:
                        # A socket's worth at a time (a receive offered a gigabyte costs
                        # the kernel more per byte than one offered a megabyte).
                        return [seg[pos:pos + RECV_BYTES]]
                    if len(segs) - i == 1:
                        return [seg[pos:], self._head]
                    first = seg[pos:]
                    if self._left <= RECV_BYTES and len(segs) - i <= IOV_MAX - 1:
                        # All the rest of it (a paged write's pages), then the next
                        # header: the views as they are, no walk adding their lengths.
                        return [first, *segs[i + 1:], self._head]
                    views = [first]
                    total = len(first)
                    for seg in islice(segs, i + 1, i + IOV_MAX - 1):
                        if total >= RECV_BYTES:
                            break
                        views.append(seg)
                        total += len(seg)
                    if total >= self._left:
                        views.append(self._head)
                    return views
            elif self._want == self._guess:
                # The usual case: nothing buffered, a frame's header next.
                self._direct = False
                self._start = self._end = 0
                return [self._head]
        self._direct = False
        room = self._room()
        # Never past the frame in hand: its header, or what of a dropped payload is left.
        want = min(self._left, len(room)) if self._kind else self._want
        return [room[:max(1, want)]]

    def _authenticated(self) -> None:
        super()._authenticated()
        assert self.peer is not None and self._view is not None
        self._key = self.peer.key
        self._head = self._view[:self._guess + SMALL_PAYLOAD]

    def received(self, n: int, now: float) -> None:
        self._now = now
        if self._direct:
            self._direct = False
            if self._crc is not None:
                assert self._crc_fn is not None
                self._crc = crc.crc_span(self._crc_fn, self._segs, self._seg, self._pos,
                                         min(n, self._left), self._crc)
            left = self._left - n
            if left > 0:
                self._advance(n)
                return
            # The payload is whole; what came after it is the next header's start.
            self._end = -left
            self._left = 0
            self._finish()
            if self._end:
                self._frames()
            else:
                self._want = self._guess
            return
        super().received(n, now)

    def _advance(self, n: int) -> None:
        """``n`` payload bytes went straight into the segments."""
        self._left -= n
        segs = self._segs
        pos = self._pos + n
        i = self._seg
        while i < len(segs) and pos >= len(segs[i]):
            pos -= len(segs[i])
            i += 1
        self._seg, self._pos = i, pos

    def _copy(self, data: memoryview) -> None:
        """Payload bytes that came into the buffer: to the segments (or dropped)."""
        self._left -= len(data)
        if self._drop:
            return
        if self._collect:
            assert self._msg is not None
            self._msg += data
            return
        if COUNTING:
            count("peer.buffered", len(data))  # (only after a header shorter than guessed)
        if self._crc is not None:
            assert self._crc_fn is not None
            self._crc = self._crc_fn(data, self._crc)
        segs = self._segs
        i, off, total = self._seg, self._pos, len(data)
        if off == 0 and i == 0 and len(segs) == 1 and total == len(segs[0]):
            segs[0][:] = data  # the whole payload of a one-page write
            self._seg = 1
            return
        self._seg, self._pos = scatter_into(segs, i, off, data)

    def _frames(self) -> None:
        """Every whole frame in the buffer, in order, until one needs more bytes."""
        if self.state is LinkState.SETUP:
            self._setup_frames()
            return
        if not self.stream_frames and self._end > self._start and not self._messages:
            self.close(BadFrame("a frame on a link that carries none after its set-up"))
            return
        buf, view = self._buf, self._view
        assert buf is not None and view is not None
        while self.state is LinkState.READY:
            start, end = self._start, self._end
            if self._kind:
                if start == end:
                    return
                k = min(end - start, self._left)
                self._copy(view[start:start + k])
                self._start = start + k
                if self._left:
                    return
                self._finish()
                continue
            avail = end - start
            if not avail:
                self._want = self._guess
                return
            cmd = buf[start]
            try:
                if cmd == WRITE:
                    if avail < 48:
                        self._want = self._guess - avail
                        return
                    head = WRITE_HEAD.unpack_from(buf, start)
                    flags, npages, ext = head[1], head[2], head[7]
                    if npages == 1 and not flags & 0xF2 and not ext:
                        size = 64  # one page, no span (the small write)
                    elif npages == 1 and not flags & 0xF2 and ext <= MAX_GUESS_EXT:
                        size = 64 + ext  # the small write, verified or traced
                        if size > self._guess:
                            self._guess = size
                            self._head = view[:size + SMALL_PAYLOAD]
                    else:
                        if flags & ~KNOWN_FLAGS or npages > MAX_PAGES or ext > MAX_EXT:
                            check_write_head(flags, npages, ext)
                        size = 48 + write_table_len(flags, npages, ext)
                        if self._guess < size <= MAX_GUESS_TABLE:
                            # This link carries paged writes: the next frame's start is
                            # read as one such header (one receive for it, not two).
                            self._guess = size
                            self._head = view[:size + SMALL_PAYLOAD]
                    if avail < size:
                        self._want = size - avail
                        return
                    self._start = start + size
                    self._open_write(buf, start, head)
                elif cmd == SEND:
                    if avail < 24:
                        self._want = 24 - avail
                        return
                    _, flags, ext, part, op, plen = SEND_HEAD.unpack_from(buf, start)
                    if flags or ext:  # (a traced SEND: its extension block after 24)
                        check_send_head(flags, ext)
                        if avail < 24 + ext:
                            self._want = 24 + ext - avail
                            return
                        self._start = start + 24 + ext
                        self._open_send(op, part, plen, buf, start + 24, ext)
                    else:
                        self._start = start + 24
                        self._open_send(op, part, plen)
                elif cmd == READ:
                    if avail < 32:
                        self._want = 32 - avail
                        return
                    head = READ_HEAD.unpack_from(buf, start)
                    check_read_head(head[1], head[2])
                    size = 32 + 16 * head[2]
                    if head[1] & RX_EXT:  # (a traced READ: 40 bytes, then its block)
                        if avail < 40:
                            self._want = 40 - avail
                            return
                        size += 8 + read_ext_len(buf, start)
                    if avail < size:
                        # The rest of its table and, in the same receive, the start of
                        # the next frame (what the frame-start read would take next):
                        # one receive a READ while a reader's READs come back to back.
                        self._want = size - avail + self._guess
                        return
                    self._start = start + size
                    self._serve_read(buf, start, head)
                else:
                    raise BadFrame(f"peer frame 0x{cmd:02x}: not a WRITE, a SEND or a READ")
            except TransferdError as exc:  # a frame whose framing cannot be trusted
                self.close(exc)
                return

    def incoming(self) -> Incoming | None:
        """The WRITE being received now, if one is (what is in flight here)."""
        adm = self._adm
        if self._kind != WRITE or adm is None or self._drop:
            return None
        return Incoming(self._ref, self._key, self.rail, self._nbytes - self._left,
                       self._nbytes, adm.header.trace, self._opened)

    def answering(self) -> list[Incoming]:
        """The READs answered here whose bytes are not all sent yet (what is in flight:
        ``received`` is the bytes of each answer gone so far)."""
        if not self._serving:
            return []
        total = self._sent_total
        return [Incoming(ref, self._key, self.rail, min(nbytes, max(0, total - end + nbytes)),
                         nbytes, trace, since, "read")
                for end, _, ref, nbytes, trace, since in list(self._serving)]

    def _open_write(self, buf: bytearray, start: int, head: tuple[int, ...]) -> None:
        op, part, plen = head[4], head[3], head[9]
        self._opened = self._now
        self._kind, self._ref, self._nbytes, self._left = WRITE, (op, part), plen, plen
        self._seg = self._pos = 0
        self._crc = None
        try:
            try:
                w = parse_write(buf, start, head)
            except TransferdError as exc:
                self.landing.refused(exc)
                raise
            self._adm = adm = self.landing.open(self._key, self.rail, w, plen, self._abort)
        except TransferdError as exc:
            self._adm, self._refusal, self._segs, self._drop = None, exc, (), True
        else:
            self._refusal = None
            self._segs = adm.views
            self._drop = adm.duplicate
            if w.crc is not None and not adm.duplicate and (
                    adm.deferred or len(w.addrs) < 2 or _disjoint(w.addrs, w.lens)):
                # (Pages that overlap: what is placed is not the bytes as they came,
                # and a receive's read-back would see a later page's: verified over
                # the pages once placed, whatever the cut, as before.)
                try:
                    self._crc_fn = crc.require()
                except TransferdError:
                    pass  # (verify refuses it, saying what to install)
                else:
                    self._crc = 0
        if not plen:
            self._finish()

    def _open_send(self, op: int, part: int, plen: int, buf: bytearray | None = None,
                   pos: int = 0, ext: int = 0) -> None:
        self._kind, self._ref, self._nbytes, self._left = SEND, (op, part), plen, plen
        self._seg = self._pos = 0
        self._adm = None
        refusal: TransferdError | None = None
        self._trace = None
        if ext:
            assert buf is not None
            try:
                self._trace = parse_send_ext(buf, pos, ext)
            except TransferdError as exc:  # framed: the message is refused, the link goes on
                refusal = exc
        if plen > self.max_message:
            # Collected in memory: a size only the sender vouches for is checked first.
            refusal = BadRequest(f"message of {plen} bytes is over the limit of "
                                 f"{self.max_message}")
        if refusal is not None:
            self._refusal = refusal
            self._msg, self._segs, self._drop = None, (), True
            self._kind = -SEND
        else:
            self._refusal = None
            self._msg = bytearray()
            self._segs = ()
            self._drop = False
            self._collect = True
        if not plen:
            self._finish()

    def _serve_read(self, buf: bytearray, start: int, head: tuple[int, ...]) -> None:
        """A READ: checked (rights, bounds) before a byte is touched, then answered with
        a READ_DATA whose payload is the region's own pages (views), or its refusal."""
        op, part = head[4], head[3]
        out = self.out
        r: ReadHeader | None = None
        try:
            r = parse_read(buf, start, head)
            if r.crc:
                crc.require()  # (none here: refused, saying what to install)
            # With RX_CRC the memory side may take the checksum itself, off this loop
            # (a long answer's: the source is then deferred until it has).
            src = self.landing.read(self.rail, r.rkey, r.addrs, r.lens, self._abort,
                                    checksum=r.crc, peer=self._key)
        except TransferdError as exc:
            self.events.append(Refused((op, part), exc, r.trace if r is not None else None,
                                       what="read"))
            out.push(encode_read_data(op, part, 0, exc))
        else:
            if not self._served_any:
                self._served_any = True
                self.events.append(ReadsServed())
            if src.deferred:
                # Device memory: its bytes go to staging first; nothing more is read
                # (answers stay in order) until they are there (:meth:`staged`).
                self._staging.append(src)
                self._hold()
                self.events.append(StageRead(src, (op, part), r.nbytes, r.crc, r.trace))
                return
            self._answer(op, part, r.nbytes, src, r.crc, r.trace)
        self._watch_answers()

    def staged(self, ev: StageRead, error: TransferdError | None) -> None:
        """A READ's bytes reached staging (None) or could not (the device's fault): answer
        it, and read on."""
        if self.state is LinkState.CLOSED:
            return  # (abandoned at the close: let go by its memory side)
        src = ev.source
        if src in self._staging:
            self._staging.remove(src)
        op, part = ev.ref
        if error is not None:
            src.release()
            self.events.append(Refused(ev.ref, error, what="read"))
            self.out.push(encode_read_data(op, part, 0, error))
        else:
            self._answer(op, part, ev.nbytes, src, ev.crc, ev.trace)
        self._watch_answers()
        self._release()

    def _answer(self, op: int, part: int, nbytes: int, src: Placement, checked: bool = False,
                trace: bytes | None = None) -> None:
        """The READ_DATA: its payload the region's views (or the staging chunks its bytes
        went to); ``checked``: with the CRC32C of those bytes, taken here from them before
        they go (a corrupting path, Landing.corrupt_read, changes only what is sent)."""
        out = self.out
        views: Sequence[memoryview] = src.views
        ext = b""
        if checked:
            taken = src.crc  # (the memory side's, where it took it)
            ext = encode_ext(crc.crc_of(views) if taken is None else taken, None)
        corrupt = self.landing.corrupt_read
        if corrupt is not None and nbytes:
            views = corrupt(views) or views
        out.push(encode_read_data(op, part, nbytes, None, ext))
        out.extend(views, nbytes)
        self._serving.append((self._sent_total + out.queued, src, (op, part), nbytes, trace,
                              self._now))
        if trace is not None:
            # The responder's record of a traced read (its log, with the trace id).
            self.events.append(Placed((op, part), nbytes, trace, self._now, what="read"))

    def _watch_answers(self) -> None:
        out = self.out
        if out.queued > (READ_HIGH if self._serving else ACK_HIGH) and not self._read_held:
            # The responder's outstanding reads are bounded by what its output holds:
            # above the watermark it reads no further frame until the peer took them.
            self._read_held = True
            self._hold()

    def _finish(self) -> None:
        """The frame's payload is whole: land or refuse, and answer."""
        kind, ref, nbytes = self._kind, self._ref, self._nbytes
        self._kind = 0
        self._collect = False
        if kind == WRITE:
            adm, self._adm = self._adm, None
            if adm is None:
                assert self._refusal is not None
                self.events.append(Refused(ref, self._refusal))
                self._ack(ref, self._refusal)
            elif adm.duplicate:
                adm.commit(nbytes)
                self._ack(ref, None)
            elif adm.header.crc is not None and self._mismatch(adm, ref):
                pass
            elif adm.deferred:
                self._hold()
                self.events.append(Land(adm, ref, nbytes, self._opened))
            else:
                adm.commit(nbytes)
                if adm.met:
                    self.acks_later = True
                self._ack(ref, None)
                if adm.header.trace is not None:
                    self.events.append(Placed(ref, nbytes, adm.header.trace, self._opened))
        elif kind == SEND:
            msg, self._msg = self._msg, None
            self.events.append(Deliver(self._key, bytes(msg or b""), ref, self._trace))
        else:  # a refused SEND
            assert self._refusal is not None
            self.events.append(Refused(ref, self._refusal, self._trace, what="message"))
            self._ack(ref, self._refusal)
        self._segs = ()

    def _mismatch(self, adm: Admission, ref: tuple[int, int]) -> bool:
        """Verify a checksummed part over what was placed; on a mismatch refuse it
        (nothing counts; the initiator re-sends it once) and True.  A link whose
        checksums fail MISMATCH_CUTOFF times in a row is cut off: its sender's
        copies are not to be trusted with more."""
        try:
            got, self._crc = self._crc, None
            err: TransferdError | None = adm.verify(got)
        except TransferdError as exc:  # no crc32c here: refused, never skipped
            err = exc
        if err is None:
            self.mismatches = 0
            return False
        adm.fail(err)
        self.events.append(Refused(ref, err, adm.header.trace))
        self._ack(ref, err)
        if isinstance(err, IntegrityError):
            self.mismatches += 1
            if self.mismatches >= MISMATCH_CUTOFF:
                self.close(IntegrityError(f"{self.mismatches} checksum mismatches in a row "
                                          "on this link: cut off"))
        return True

    def _ack(self, ref: tuple[int, int], error: TransferdError | None) -> None:
        out = self.out
        out.push(encode_ack(ref[0], ref[1], error))
        if out.queued > ACK_HIGH and not self._ack_held:
            self._ack_held = True
            self._hold()

    def _hold(self) -> None:
        self._holds += 1
        if self.state is LinkState.READY:
            self._move(LinkInput.HOLD)

    def _release(self) -> None:
        self._holds -= 1
        if not self._holds and self.state is LinkState.PAUSED:
            self._move(LinkInput.RELEASE)
            self._frames()  # what came while held, in order

    # -- answers the I/O side brings back -------------------------------------------------

    def sent(self, n: int) -> None:
        self.out.sent(n)
        if self._serving:
            self._sent_total += n
            serving, total = self._serving, self._sent_total
            while serving and serving[0][0] <= total:
                serving.popleft()[1].release()  # its bytes are in the kernel's hands
            if not serving:
                self._sent_total = 0  # (marks are relative to the output's start)
        if self._read_held and self.out.queued <= (READ_LOW if self._serving else ACK_LOW):
            self._read_held = False
            self._release()
        if self._ack_held and self.out.queued <= ACK_LOW:
            self._ack_held = False
            self._release()

    def delivered(self, ref: tuple[int, int], error: TransferdError | None) -> None:
        """A message's receive has it (None), or cannot (the error goes back)."""
        if self.state is not LinkState.CLOSED:
            self._ack(ref, error)

    def landed(self, land: Land, error: TransferdError | None) -> None:
        """A deferred landing ended: count it (or fail it) and answer; reading goes on."""
        if error is None:
            land.admission.commit(land.nbytes)
            trace = land.admission.header.trace
            if trace is not None:
                self.events.append(Placed(land.ref, land.nbytes, trace, land.opened))
        else:
            land.admission.fail(error)
            self.events.append(Refused(land.ref, error))
        if self.state is not LinkState.CLOSED:
            self._ack(land.ref, error)
            self._release()

    def _ready(self) -> None:
        self._frames()

    def _closing(self, error: TransferdError | None) -> None:
        if self._serving:
            # Reads' bytes are views of regions about to be let go: none of them is
            # sent after the close (the reader's link fails them, or re-reads).
            self.out.clear()
            while self._serving:
                self._serving.popleft()[1].release()
        # A READ whose memory side is not ready yet: nothing more is done for it (a
        # checksum not begun is not taken), and it is let go once whatever runs on it
        # ended; its staged() comes for nobody.
        staging, self._staging = self._staging, []
        for src in staging:
            src.abandon()
        # What is in :attr:`out` (a refusal's reason, ACKs) may still be sent once.
        adm, self._adm = self._adm, None
        if adm is not None and self._kind:
            adm.fail(None)  # closed mid-payload: nothing of it counts; a retry may land
        self._kind = 0
        self._collect = False
        self._msg = None


__all__ = ["InboundLink"]
