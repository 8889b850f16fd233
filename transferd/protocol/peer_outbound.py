"""Our end of a peer link we dialled, sans-IO (see :mod:`.peer_link`).

It runs the handshake as initiator, then takes parts to send (WRITE, SEND and READ
frames, each with a token of the Domain's) and gives back their completions as the
peer's ACKs (and READ_DATA) come; while the link is not yet READY, or PAUSED over its
send watermark, parts wait in order.

A READ's answer is received straight into the views the part names (our region),
never through a bytes object: only the bytes that came in the link's buffer with the
header are copied there from it.  A READ_DATA for a read this link never asked, or of
another length than asked, cuts the link before any of its bytes is touched.  The
payload of a read whose transfer already ended (timed out, cancelled) is received and
dropped, never written to memory its owner may have had back.

The frames in the output are known part by part (:class:`PartOutput`): when a
transfer ends other than by success (failed, timed out, cancelled), :meth:`OutboundLink.
let_go_ended` drops at once every frame of it not yet begun, and the parts of it still
waiting, so that no view of its source outlives it (a held view makes the buffer's
unmapping fail) and none of its bytes go later; a frame of it already half sent cannot
be taken back from the stream, so the link is cut then (the other parts on it fail
PEER_UNREACHABLE: another rail may take them).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

from . import crc as crc32c
from .errors import (
    BadFrame,
    BadRequest,
    IntegrityError,
    PeerAnswered,
    PeerUnreachable,
    TransferdError,
)
from .keyring import Keyring
from .peer_ext import encode_ext, parse_ext
from .peer_handshake import SEND_EXT, PeerHandshake, PeerIdentity, Role
from .peer_link import (
    HIGH_WATER,
    LOW_WATER,
    SEND_BYTES,
    LinkEnd,
    LinkInput,
    LinkState,
    Output,
    scatter_into,
)
from .peer_wire import (
    ACK,
    ACK_HEAD,
    MAX_ERROR_TEXT,
    MAX_EXT,
    READ_DATA,
    READ_DATA_HEAD,
    ack_error,
    encode_read,
    encode_send,
    encode_write,
)

# The most views one receive of a READ's payload is offered, and its bytes.
_IOV = 512
_RECV = 1 << 20
# Checksum mismatches in a row (answers to verified reads) after which the link is cut:
# the peer's copies are not to be trusted with more (as peer_inbound's for writes).
MISMATCH_CUTOFF = 4


def _ended(token: Any) -> bool:
    return bool(getattr(token, "finished", False))


class _Queued:
    """One frame in the output: whose (``token``; None: not a part's, the handshake's
    bytes), which part (``key``), its bytes not yet sent, whether its first byte went."""

    __slots__ = ("begun", "key", "left", "token")

    def __init__(self, token: Any, key: tuple[int, int] | None, left: int) -> None:
        self.token = token
        self.key = key
        self.left = left
        self.begun = False


class PartOutput(Output):
    """An outbound link's output, which knows what part each frame is of: the frames of
    an ended transfer not yet begun can be taken out (their views with them).

    Every frame's bytes are whole entries of the queue (a header, its payload's views),
    so a frame is taken out by leaving out its entries, never by cutting one."""

    __slots__ = ("_frames", "skipped")

    def __init__(self) -> None:
        super().__init__()
        self._frames: deque[_Queued] = deque()
        # Parts whose frames :meth:`views` left out (their transfer ended before the
        # link's own pass came): what the link forgets of them then.
        self.skipped: list[tuple[int, int]] = []

    def views(self, max_bytes: int = SEND_BYTES) -> list[memoryview | bytes]:
        # A transfer that ended this turn: its frames at the front never go, even
        # before the link's pass over everything it holds (let_go_ended).
        frames = self._frames
        while frames:
            f = frames[0]
            if f.begun or not getattr(f.token, "finished", False):
                break
            frames.popleft()
            left = f.left
            q = self._q
            while left:
                left -= len(q.popleft())
            self.queued -= f.left
            assert f.key is not None
            self.skipped.append(f.key)
        return Output.views(self, max_bytes) if self.queued else []

    def push(self, data: bytes | memoryview) -> None:
        # Bytes of no part (the handshake's): one entry with the ones before it.
        if data:
            super().push(data)
            frames = self._frames
            if frames and frames[-1].token is None:
                frames[-1].left += len(data)
            else:
                frames.append(_Queued(None, None, len(data)))

    def frame(self, token: Any, key: tuple[int, int], head: bytes,
              body: Sequence[memoryview], nbytes: int) -> None:
        """A part's frame: ``head``, then ``body`` (``nbytes`` in all), sent as views."""
        q = self._q
        q.append(head)
        if len(body) == 1:
            if nbytes:
                q.append(body[0])
        elif body:
            q.extend(filter(None, body))  # the pages' views at once
        size = len(head) + nbytes
        self.queued += size
        self._frames.append(_Queued(token, key, size))

    def sent(self, n: int) -> None:
        frames = self._frames
        if n == self.queued:
            # All of it went (the usual send): no walk over its views or frames.
            self._q.clear()
            self.queued = 0
            frames.clear()
            return
        Output.sent(self, n)
        while n:
            f = frames[0]
            if n >= f.left:
                n -= f.left
                frames.popleft()
            else:
                f.left -= n
                f.begun = True
                return

    def take(self) -> list[memoryview | bytes]:
        self._frames.clear()
        self.skipped.clear()
        return super().take()

    def clear(self) -> None:
        self._frames.clear()
        self.skipped.clear()
        super().clear()

    def half_sent_ended(self) -> bool:
        """The frame being sent is of an ended transfer (only a cut stops it)."""
        frames = self._frames
        return bool(frames) and frames[0].begun and _ended(frames[0].token)

    def drop_ended(self) -> list[tuple[int, int]]:
        """Take out every frame not yet begun whose transfer ended; their parts."""
        frames = self._frames
        if not any(not f.begun and _ended(f.token) for f in frames):
            return []
        q = iter(self._q)
        entries: deque[memoryview | bytes] = deque()
        kept: deque[_Queued] = deque()
        dropped: list[tuple[int, int]] = []
        for f in frames:
            drop = not f.begun and _ended(f.token)
            left = f.left
            while left:
                v = next(q)
                left -= len(v)
                if not drop:
                    entries.append(v)
            if drop:
                self.queued -= f.left
                assert f.key is not None
                dropped.append(f.key)
            else:
                kept.append(f)
        self._q, self._frames = entries, kept
        return dropped


class _Incoming:
    """The READ_DATA whose payload is being received: where its bytes go.

    ``ends`` are the segments' cumulative ends, so that finding where the next byte
    goes, and which segments one receive is offered, costs a bisection, not a walk
    over every page a receive filled (4,096 pages a paged read)."""

    __slots__ = ("crc", "done", "ends", "fn", "left", "pos", "ref", "seg", "segs", "token",
                 "want")

    def __init__(self, token: Any, segs: Sequence[memoryview], left: int,
                 ends: list[int], want: int | None = None, fn: crc32c.CrcFn | None = None,
                 ref: tuple[int, int] = (0, 0)) -> None:
        self.token = token
        self.segs = segs
        self.ends = ends
        self.seg = 0
        self.pos = 0
        self.done = 0
        self.left = left
        # A verified read's: the responder's CRC32C of the payload, ours so far (taken
        # over each receive's bytes as they are placed, while in cache), the function.
        self.want = want
        self.crc = 0
        self.fn = fn
        self.ref = ref

    @property
    def dropping(self) -> bool:
        # Its transfer ended (the memory may be its owner's again): bytes are dropped.
        return self.token is None or bool(getattr(self.token, "finished", False))

    def put(self, data: memoryview) -> None:
        """Bytes of the payload that came in the link's buffer."""
        self.left -= len(data)
        self.done += len(data)
        if self.dropping:
            return
        if self.fn is not None:
            self.crc = self.fn(data, self.crc)
        self.seg, self.pos = scatter_into(self.segs, self.seg, self.pos, data)

    def views(self) -> list[memoryview]:
        """The rest of the payload, straight into place (a socket's worth)."""
        segs, i = self.segs, self.seg
        first = segs[i][self.pos:]
        if len(first) >= _RECV:
            return [first[:_RECV]]
        # Up to the first segment that takes the receive past _RECV bytes, _IOV in all.
        j = bisect_left(self.ends, self.done + _RECV, i + 1)
        return [first, *segs[i + 1:min(j + 1, i + _IOV)]]

    def advance(self, n: int) -> None:
        if self.fn is not None and not self.dropping:
            self.crc = crc32c.crc_span(self.fn, self.segs, self.seg, self.pos, n, self.crc)
        self.left -= n
        done = self.done = self.done + n
        ends = self.ends
        i = bisect_right(ends, done, self.seg)
        self.seg = i
        self.pos = done - ends[i - 1] if i else done


class OutboundLink(LinkEnd):
    """Our end of a link we dialled (see the module docstring).

    Parts carry a ``token`` (the Domain's: what to complete); :attr:`completions`
    collects ``(token, error or None)`` as ACKs come, and :meth:`close` hands back
    every token still owed an answer.
    """

    def __init__(self, me: PeerIdentity, rail: int, secret: bytes | Keyring | None, now: float, *,
                 expect: tuple[int, int, bytes], timeout: float,
                 admit: Callable[[PeerIdentity], None] | None = None,
                 high_water: int = HIGH_WATER, low_water: int = LOW_WATER,
                 label: str = "peer link",
                 everyone: tuple[tuple[bytes, ...], ...] | None = None,
                 random: Callable[[int], bytes] | None = None) -> None:
        kw: dict[str, Any] = {} if random is None else {"random": random}
        super().__init__(PeerHandshake(Role.INITIATOR, me, rail, secret, now, timeout=timeout,
                                       expect=expect, admit=admit, everyone=everyone, **kw))
        self.high_water, self.low_water = high_water, low_water
        # What is queued to send, frame by frame (its parts' views, until sent or ended).
        self._sending = PartOutput()
        self.out = self._sending
        # Names the link in the errors its parts fail with ("link to NODE rail R").
        self.label = label
        # Parts taken before the link was ready or while it was paused, in order.
        self._waiting: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._pending: dict[tuple[int, int], Any] = {}
        # Reads asked and not yet answered: where each one's bytes go, and the views'
        # cumulative ends (the last is the length asked), taken when the READ went out.
        self._reads: dict[tuple[int, int], tuple[Sequence[memoryview], list[int]]] = {}
        self._in: _Incoming | None = None
        self._dropped = False  # the last receive went to the buffer (a dropped payload)
        # Reads asked with RX_CRC and not yet answered: their answer must carry one.
        self._crc_asked: set[tuple[int, int]] = set()
        # Answers to verified reads whose checksum failed, in a row (MISMATCH_CUTOFF).
        self.mismatches = 0
        self.completions: list[tuple[Any, TransferdError | None]] = []

    @property
    def nonce(self) -> bytes:
        """The handshake's nonce (a PROBE for this link names it)."""
        return self.hs.nonce

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        """Ready, with nothing waiting, in flight or unsent."""
        return (self.state is LinkState.READY and not self._pending and not self._waiting
                and not self.out.queued)

    def connected(self, now: float) -> None:
        """The dial got through: HELLO goes out."""
        self._move(LinkInput.CONNECTED)
        self.hs.start()
        self.out.push(self.hs.data_to_send())

    def probe(self, token: bytes, now: float) -> None:
        """Without a cluster secret: the token a PROBE brought to our listener."""
        if self.state is not LinkState.HANDSHAKE:
            return
        try:
            self.hs.probe(token, now)
        except TransferdError as exc:
            self._fail(exc)
            return
        self._after_handshake_step()

    # -- parts ----------------------------------------------------------------------------

    def write(self, token: Any, op: int, part: int, rkey: int, addrs: list[int],
              lens: list[int], src: Sequence[memoryview], imm: int | None,
              span: Sequence[int] | None = None, wid: int | None = None,
              again: bool = False, ext: bytes | Callable[[], bytes] = b"") -> None:
        """Send a WRITE of ``src`` (the pages' bytes, as views: never copied); ``ext``
        its extension block (:mod:`.peer_ext`: checksum, trace id), or what makes it
        when the WRITE goes into the output (a checksum is taken then, not while the
        part waits behind the send watermark: the parts of a large write each take
        theirs as the ones before drain)."""
        if self.state is LinkState.READY:
            if not isinstance(ext, bytes):
                ext = ext()
            key = (op, part)
            self._pending[key] = token
            out = self._sending
            out.frame(token, key, encode_write(op, part, rkey, addrs, lens, imm, span, wid,
                                               again, ext),
                      src, len(src[0]) if len(src) == 1 else sum(map(len, src)))
            if out.queued > self.high_water:
                self._move(LinkInput.HOLD)
        elif self.state is LinkState.CLOSED:
            self.completions.append((token, self._closed_error()))
        else:
            self._waiting.append((self.write, (token, op, part, rkey, addrs, lens, src, imm,
                                               span, wid, again, ext)))

    def send(self, token: Any, op: int, part: int, message: bytes | memoryview,
             trace: bytes | None = None) -> None:
        """Send a SEND (a two-sided message); completed when the peer's client has it.
        ``trace``: the W3C trace id, carried in the frame (TX_EXT) when the responder
        said it reads a SEND's extension block (``send-ext``), else kept here only."""
        if self.state is LinkState.READY:
            key = (op, part)
            self._pending[key] = token
            if trace is not None and SEND_EXT in self.hs.peer_features:
                head = encode_send(op, part, len(message), encode_ext(None, trace))
            else:
                head = encode_send(op, part, len(message))
            self._sending.frame(token, key, head, (memoryview(message),), len(message))
            if self.out.queued > self.high_water:
                self._move(LinkInput.HOLD)
        elif self.state is LinkState.CLOSED:
            self.completions.append((token, self._closed_error()))
        else:
            self._waiting.append((self.send, (token, op, part, message, trace)))

    def read(self, token: Any, op: int, part: int, rkey: int, addrs: list[int],
             lens: list[int], into: Sequence[memoryview], verify: bool = False,
             trace: bytes | None = None) -> None:
        """Send a READ of the peer's pages; its answer lands in ``into`` (views of our
        own memory, ``lens`` bytes in all), and ``token`` completes when it is whole.
        ``verify``: the answer must carry its CRC32C, and ours of the bytes placed must
        match it; ``trace``: the W3C trace id, for the responder's log records."""
        if self.state is LinkState.READY:
            key = (op, part)
            self._pending[key] = token
            self._reads[key] = (into, list(accumulate(map(len, into))))
            if verify or trace is not None:
                if verify:
                    self._crc_asked.add(key)
                frame = encode_read(op, part, rkey, addrs, lens, verify,
                                    encode_ext(None, trace) if trace is not None else b"")
            else:
                frame = encode_read(op, part, rkey, addrs, lens)
            self._sending.frame(token, key, frame, (), 0)
        elif self.state is LinkState.CLOSED:
            self.completions.append((token, self._closed_error()))
        else:
            self._waiting.append((self.read, (token, op, part, rkey, addrs, lens, into, verify,
                                              trace)))

    def forget(self, op: int, part: int) -> Any:
        """Stop waiting for the ACK of ``(op, part)`` (its transfer ended); its token."""
        return self._pending.pop((op, part), None)

    def let_go_ended(self) -> None:
        """Let go of everything held for parts whose transfer ended (failed, timed out,
        cancelled) with no answer yet: the parts still waiting and the frames not yet
        begun go unsent (their views with them), their tokens, and the views a read's
        answer was to land in.  A read that went keeps only its length, so that a late
        answer is still framed, and dropped.  A frame of an ended transfer half sent
        cuts the link: the rest of it would go later, and hold its views until then."""
        if self.state is LinkState.CLOSED:
            return
        # (An ended transfer is owed no answer, even when the link is cut.)
        waiting = self._waiting
        if waiting and any(_ended(args[0]) for _, args in waiting):
            self._waiting = deque(w for w in waiting if not _ended(w[1][0]))
        pending, reads = self._pending, self._reads
        out = self._sending
        if out.half_sent_ended():
            for key in [k for k, t in pending.items() if _ended(t)]:
                del pending[key]
            self.close(PeerUnreachable(
                f"{self.label}: cut, a part of a transfer that ended was half sent (its "
                "peer took too little of it in time)"))
            return
        skipped, out.skipped = out.skipped, []
        for key in [*skipped, *out.drop_ended()]:
            pending.pop(key, None)
            reads.pop(key, None)  # (never asked: no answer comes)
            self._crc_asked.discard(key)
        ended = [k for k, t in pending.items() if _ended(t)]
        for key in ended:
            del pending[key]
            asked = reads.get(key)
            if asked is not None:
                reads[key] = ((), asked[1][-1:])
        inc = self._in
        if inc is not None and inc.dropping:
            inc.segs = ()  # (its bytes are dropped from here on)
        if self.state is LinkState.PAUSED and out.queued <= self.low_water:
            self._move(LinkInput.RELEASE)
            self._ready()

    def sent(self, n: int) -> None:
        """``n`` bytes of :attr:`out` went; below the low watermark a paused link goes on."""
        self.out.sent(n)
        if self.state is LinkState.PAUSED and self.out.queued <= self.low_water:
            self._move(LinkInput.RELEASE)
            self._ready()

    def _ready(self) -> None:
        waiting = self._waiting
        while waiting and self.state is LinkState.READY:
            fn, args = waiting.popleft()
            fn(*args)

    def _error_of(self, exc: TransferdError) -> TransferdError:
        # A configuration mismatch stays a BAD_REQUEST (another rail count, say); the
        # rest is a link that could not be made or went wrong: PEER_UNREACHABLE.
        kind = BadRequest if type(exc) is BadRequest else PeerUnreachable
        return kind(f"{self.label}: {exc.message}")

    def _closed_error(self) -> TransferdError:
        """What a part given to a closed link fails with (another rail may take it)."""
        err = self.error
        if type(err) is PeerUnreachable or type(err) is BadRequest:
            return err
        return PeerUnreachable(f"{self.label} is closed{': ' + err.message if err else ''}")

    def _closing(self, error: TransferdError | None) -> None:
        self.out.clear()
        # What it held fails with the reason it closed (a transfer's own TIMEOUT, say).
        err = error or self._closed_error()
        for _, args in self._waiting:
            self.completions.append((args[0], err))
        self._waiting.clear()
        for token in self._pending.values():
            self.completions.append((token, err))
        self._pending.clear()
        self._reads.clear()
        self._crc_asked.clear()
        self._in = None

    # -- the peer's ACKs -------------------------------------------------------------------

    def _authenticated(self) -> None:
        # ACKs are 16 bytes (an error's message at most 4 KiB more).
        self._buf = bytearray(64 * 1024)
        self._view = memoryview(self._buf)

    @property
    def in_frame(self) -> bool:
        return self._in is not None

    def get_buffers(self) -> list[memoryview]:
        inc = self._in
        if inc is None or self._buf is None:
            return super().get_buffers()
        view = self._view
        assert view is not None
        if inc.dropping:
            self._dropped = True
            return [view[:min(inc.left, len(view))]]
        self._dropped = False
        return inc.views()

    def received(self, n: int, now: float) -> None:
        inc = self._in
        if inc is None or self._buf is None:
            super().received(n, now)
            return
        if self._dropped:
            inc.left -= n
        else:
            inc.advance(n)
        if not inc.left:
            self._in = None
            if not inc.dropping:  # (an ended transfer is owed nothing)
                self._whole(inc)

    def _whole(self, inc: _Incoming) -> None:
        """Every byte of a read's answer is in place: its completion, a verified one's
        only if our checksum of the bytes placed is the responder's (else INTEGRITY:
        the part is re-read once, domains/failover.py)."""
        if inc.want is None or inc.crc == inc.want:
            if inc.want is not None:
                self.mismatches = 0
            self.completions.append((inc.token, None))
            return
        op, part = inc.ref
        self.completions.append((inc.token, IntegrityError(
            f"checksum mismatch: the answer to READ part {part} of op {op} ({inc.done} "
            f"bytes) on the {self.label}: CRC32C 0x{inc.crc:08x} placed, 0x{inc.want:08x} "
            "sent")))
        self.mismatches += 1
        if self.mismatches >= MISMATCH_CUTOFF:
            self.close(PeerUnreachable(f"{self.label}: {self.mismatches} checksum "
                                       "mismatches in a row: cut off"))

    def _read_data(self, start: int, end: int) -> int:
        """The READ_DATA at ``start``: its answer, or its payload begun; where the next
        frame starts, or -1 until its header is whole.  BadFrame for one nobody asked."""
        buf = self._buf
        assert buf is not None
        _, status, mlen, part, op, plen = READ_DATA_HEAD.unpack_from(buf, start)
        key = (op, part)
        if status:
            if mlen > MAX_ERROR_TEXT or plen:
                raise BadFrame(f"a refused READ_DATA with a {mlen}-byte message and "
                               f"{plen} bytes")
            if end - start < 24 + mlen:
                return -1
            if key not in self._reads:
                raise BadFrame(f"READ_DATA for op {op} part {part}: no such read asked")
            del self._reads[key]
            self._crc_asked.discard(key)  # (refused: no checksum comes for it)
            token = self._pending.pop(key, None)
            if token is not None:
                self.completions.append((token, ack_error(status, buf[start + 24:
                                                                    start + 24 + mlen])))
            return start + 24 + mlen
        got: int | None = None
        if mlen:
            # An extension block (peer_ext: the payload's CRC32C), only ever sent to a
            # READ that asked for it (RX_CRC): its whole length is in the buffer first.
            if mlen > MAX_EXT:
                raise BadFrame(f"an ok READ_DATA with a {mlen}-byte extension block (at "
                               f"most {MAX_EXT})")
            if end - start < 24 + mlen:
                return -1
            if key not in self._crc_asked:
                raise BadFrame(f"READ_DATA for op {op} part {part} with an extension block "
                               "its READ did not ask for")
            try:
                got, _ = parse_ext(buf, start + 24, mlen, "READ_DATA")
            except BadRequest as exc:  # (framed: but an answer we cannot trust)
                raise BadFrame(exc.message) from None
        asked = self._reads.pop(key, None)
        if asked is None:
            # Nothing of it is read: the link is cut before any byte lands anywhere.
            raise BadFrame(f"READ_DATA of {plen} bytes for op {op} part {part}: no such "
                           "read was asked on this link")
        into, ends = asked
        want = ends[-1] if ends else 0
        if plen != want:
            raise BadFrame(f"READ_DATA of {plen} bytes for op {op} part {part}, which "
                           f"asked for {want}")
        token = self._pending.pop(key, None)
        start += 24 + mlen
        fn: crc32c.CrcFn | None = None
        crc_asked = self._crc_asked
        if crc_asked and key in crc_asked:
            crc_asked.discard(key)
            if token is not None and got is None:
                # Asked and not given: refused, and its bytes dropped unplaced (a verify
                # asked for is never skipped).
                self.completions.append((token, PeerAnswered(
                    f"{self.label}: the answer to READ part {part} of op {op} came without "
                    "the checksum it asked for (verify); refused")))
                token = None
            elif token is not None:
                fn = crc32c.require()  # (this end asked: it has one)
        inc = _Incoming(token, into, plen, ends, got, fn, key) if fn is not None else \
            _Incoming(token, into, plen, ends)
        k = min(end - start, plen)
        if k:
            view = self._view
            assert view is not None
            inc.put(view[start:start + k])
        if inc.left:
            self._in = inc
        elif not inc.dropping:
            self._whole(inc)
        return start + k

    def _frames(self) -> None:
        if self.state is LinkState.SETUP:
            self._setup_frames()
            return
        buf = self._buf
        assert buf is not None
        start, end = self._start, self._end
        pending, done = self._pending, self.completions
        unpack = ACK_HEAD.unpack_from
        try:
            while end - start >= 16:
                cmd, status, mlen, part, op = unpack(buf, start)
                if cmd == READ_DATA:
                    if end - start < 24:
                        break
                    nxt = self._read_data(start, end)
                    if nxt < 0:
                        break
                    start = nxt
                    if self._in is not None or self.state is LinkState.CLOSED:
                        # The rest of its payload goes straight into place (or the link
                        # was cut off for its checksums: nothing more is read).
                        break
                    continue
                if cmd != ACK:
                    raise BadFrame(f"peer frame 0x{cmd:02x} on a link that takes ACKs only "
                                   "(and the READ_DATA of its reads)")
                if status:
                    if mlen > MAX_ERROR_TEXT:
                        raise BadFrame(f"an ACK with a {mlen}-byte message (at most "
                                       f"{MAX_ERROR_TEXT})")
                    if end - start < 16 + mlen:
                        break
                    error = ack_error(status, buf[start + 16:start + 16 + mlen])
                    start += 16 + mlen
                elif mlen:
                    # (Read as 16 bytes, its text would be taken for the next ACKs.)
                    raise BadFrame(f"an ok ACK announcing a {mlen}-byte message")
                else:
                    error = None
                    start += 16
                if (op, part) in self._reads:
                    # A read completes only with its bytes, never by an ACK.
                    raise BadFrame(f"an ACK for op {op} part {part}, a read")
                token = pending.pop((op, part), None)
                if token is not None:
                    done.append((token, error))
        except TransferdError as exc:
            self._start = start
            self.close(self._error_of(exc))
            return
        self._start = start


__all__ = ["OutboundLink"]
