"""The peer link, sans-IO: both ends of one daemon-to-daemon link, for every Domain.

An :class:`OutboundLink` is our end of a link we dialled: it runs the handshake as
initiator (:mod:`.peer_handshake`), then takes parts to send (:meth:`~OutboundLink.
write`, :meth:`~OutboundLink.send`) and gives back their completions when the
peer's ACKs come.  An :class:`InboundLink` is the end of a link a peer dialled: the
handshake as responder, then every WRITE claimed, checked and landed or failed by
the group's :class:`~.peer_landing.Landing`, and acknowledged; every SEND handed on
as a :class:`Deliver` event and acknowledged when the I/O side says a client has it.

Bytes in, bytes out, the clock passed in; no sockets, no asyncio.  An I/O loop asks
:meth:`get_buffers` where to receive (the pages of a write being received, straight
into its region, or the link's own buffer), reports what arrived with
:meth:`received`, sends what :attr:`out` holds and reports it with :meth:`sent`;
it drains :attr:`events` (and an outbound link's :attr:`completions`) after each call.
A transport of whole messages feeds :meth:`receive_message` instead and sends each
call's output as one message.

Link states are one enum and one transition table (:data:`TRANSITIONS`)::

    CONNECTING --connected--> HANDSHAKE --authenticated--> SETUP --carrier ready--> READY
    READY <--hold / release--> PAUSED;   any state --close--> CLOSED

SETUP is the Domain's own step after the handshake: verbs exchanges its queue pairs
there, one SETUP frame each way (:meth:`send_setup`, the :class:`SetUp` event), then
says :meth:`carrier_ready`; tcp's carrier is the stream itself and goes straight on.  PAUSED is
back-pressure: an outbound link whose unsent bytes passed the high watermark takes
no new part until they fall below the low one; an inbound link whose ACKs the peer
does not read (the ACK watermark), or which waits for a device write's copies,
reads nothing more until they are out.  Before the handshake is done a link takes
frames of a 4 KiB body and no payload, into an 8 KiB buffer, for at most the
handshake's timeout.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from transferd.copies import COUNTING, count

from .errors import BadFrame, BadRequest, PeerUnreachable, TransferdError
from .frames import FrameDecoder
from .peer import PeerCommand
from .peer_handshake import (
    MAX_HANDSHAKE_BODY,
    PeerHandshake,
    PeerIdentity,
    Probe,
    Ready,
    Role,
    State,
    parse_probe,
)
from .peer_landing import Admission, Landing
from .peer_wire import (
    ACK,
    ACK_HEAD,
    KNOWN_FLAGS,
    MAX_ERROR_TEXT,
    MAX_EXT,
    MAX_PAGES,
    MAX_SETUP,
    SEND,
    SEND_HEAD,
    SETUP,
    SETUP_HEAD,
    WRITE,
    WRITE_HEAD,
    ack_error,
    check_write_head,
    encode_ack,
    encode_send,
    encode_setup,
    encode_write,
    parse_write,
    write_table_len,
)

Peer = tuple[int, int]


class LinkState(enum.Enum):
    CONNECTING = "connecting"  # outbound: the dial
    HANDSHAKE = "handshake"
    SETUP = "setup"  # the Domain's carrier (verbs: queue pairs)
    READY = "ready"
    PAUSED = "paused"  # over a watermark, or a landing holds it
    CLOSED = "closed"


class LinkInput(enum.Enum):
    CONNECTED = "connected"
    AUTHENTICATED = "authenticated"
    CARRIER_READY = "carrier-ready"
    HOLD = "hold"
    RELEASE = "release"
    CLOSE = "close"


_S, _I = LinkState, LinkInput
TRANSITIONS: dict[tuple[LinkState, LinkInput], LinkState] = {
    (_S.CONNECTING, _I.CONNECTED): _S.HANDSHAKE,
    (_S.HANDSHAKE, _I.AUTHENTICATED): _S.SETUP,
    (_S.SETUP, _I.CARRIER_READY): _S.READY,
    (_S.READY, _I.HOLD): _S.PAUSED,
    (_S.PAUSED, _I.RELEASE): _S.READY,
    **{(s, _I.CLOSE): _S.CLOSED for s in LinkState if s is not _S.CLOSED},
}

# The handshake's buffer (a header and a 4 KiB body); the data phase's, once the
# peer proved itself: a WRITE's header and page table fit it with room to spare
# (48 + 16 + 16 * 4096 + 4096 bytes), and a small write arrives whole in one read.
PRE_AUTH_BUFFER = 8192
BUFFER = 256 * 1024
# An inbound link reads only what the frame in hand needs, so that a payload is
# received straight into its pages and never through the link's buffer: at a frame's
# start this much (a one-page WRITE's whole header, and no frame's header is
# shorter than 24), then the rest of its header; with a payload's last bytes, this
# much of what follows (the next header's start).
HEAD_GUESS = 64
# What one receive or send is offered (views and bytes).
IOV_MAX = 512
RECV_BYTES = 1 << 20
SEND_BYTES = 4 << 20
# Outbound: unsent bytes above HIGH pause the link until they are down to LOW (a
# slow peer holds our parts' views, not a growing queue).
HIGH_WATER = 64 * 1024 * 1024
LOW_WATER = 16 * 1024 * 1024
# Inbound: ACKs the peer has not taken above ACK_HIGH stop reading until ACK_LOW
# (a peer that writes without reading its ACKs holds itself back, not our memory).
ACK_HIGH = 256 * 1024
ACK_LOW = 64 * 1024


class Output:
    """Bytes to send, in order, as views; the count unsent against two watermarks."""

    __slots__ = ("_q", "queued")

    def __init__(self) -> None:
        self._q: deque[memoryview | bytes] = deque()
        self.queued = 0

    def push(self, data: bytes | memoryview) -> None:
        if data:
            self._q.append(data)
            self.queued += len(data)

    def views(self, max_bytes: int = SEND_BYTES) -> list[memoryview | bytes]:
        """What to offer the next send: the first views, up to ``max_bytes``."""
        q = self._q
        if len(q) == 1:
            return [q[0]]
        out: list[memoryview | bytes] = []
        total = 0
        for v in islice(q, IOV_MAX):
            out.append(v)
            total += len(v)
            if total >= max_bytes:
                break
        return out

    def take(self) -> list[memoryview | bytes]:
        """Everything queued, at once (a message transport sends it as one message)."""
        out = list(self._q)
        self._q.clear()
        self.queued = 0
        return out

    def sent(self, n: int) -> None:
        """``n`` bytes of the front went out (a view sent in part keeps its tail)."""
        self.queued -= n
        q = self._q
        while n:
            head = q[0]
            size = len(head)
            if n >= size:
                n -= size
                q.popleft()
            else:
                q[0] = memoryview(head)[n:]
                return

    def clear(self) -> None:
        self._q.clear()
        self.queued = 0


@dataclass(frozen=True, slots=True)
class ProbeArrived:
    """A PROBE came in (the first frame of a connection): hand ``token`` to our own
    outbound link whose handshake sent ``nonce``.  This link is closed."""

    nonce: bytes
    token: bytes


@dataclass(frozen=True, slots=True)
class Deliver:
    """A two-sided message from ``peer`` (the authenticated one): hand it to a posted
    receive, then call :meth:`InboundLink.delivered` with ``ref``."""

    peer: Peer
    message: bytes
    ref: tuple[int, int]


@dataclass(frozen=True, slots=True)
class Land:
    """A WRITE into memory reached through staging was received: run
    ``admission.land`` and then :meth:`InboundLink.landed` (the link reads nothing
    meanwhile)."""

    admission: Admission
    ref: tuple[int, int]
    nbytes: int


@dataclass(frozen=True, slots=True)
class SetUp:
    """The other end's set-up came (SETUP state): ``blob``, or ``error`` if it refused
    ours."""

    blob: bytes
    error: TransferdError | None


@dataclass(frozen=True, slots=True)
class Refused:
    """A WRITE was refused (its ACK carries ``error``): for the log."""

    ref: tuple[int, int]
    error: TransferdError


@dataclass(frozen=True, slots=True)
class Closed:
    """The link is over; ``error`` says why (None: closed on purpose)."""

    error: TransferdError | None


Event = Probe | Ready | ProbeArrived | Deliver | Land | SetUp | Refused | Closed


class _Link:
    """What both ends share: the state, the handshake phase, the output."""

    def __init__(self, hs: PeerHandshake) -> None:
        self.hs = hs
        self.state = LinkState.CONNECTING if hs.role is Role.INITIATOR else LinkState.HANDSHAKE
        self.peer: PeerIdentity | None = None
        self.error: TransferdError | None = None
        self.out = Output()
        self.events: list[Event] = []
        self._decoder = FrameDecoder(max_body=MAX_HANDSHAKE_BODY, max_payload=0, exact=True,
                                     buffer_size=PRE_AUTH_BUFFER)
        self._buf: bytearray | None = None
        self._view: memoryview | None = None
        self._start = self._end = 0
        self._messages = False  # frames come from receive_message now

    # -- state --------------------------------------------------------------------------

    def _move(self, what: LinkInput) -> None:
        nxt = TRANSITIONS.get((self.state, what))
        if nxt is None:
            raise BadFrame(f"peer link: {what.value} is not allowed when {self.state.value}")
        self.state = nxt

    @property
    def closed(self) -> bool:
        return self.state is LinkState.CLOSED

    @property
    def authenticated(self) -> bool:
        return self.peer is not None

    @property
    def deadline(self) -> float:
        """When the handshake times out (see :meth:`tick`)."""
        return self.hs.deadline

    def tick(self, now: float) -> None:
        """The handshake's timer: past its deadline unfinished, the link closes."""
        if self.state in (LinkState.CONNECTING, LinkState.HANDSHAKE):
            try:
                self.hs.tick(now)
            except TransferdError as exc:
                self._fail(exc)

    def close(self, error: TransferdError | None = None) -> None:
        """Close the link (the I/O side's decision, or its socket's end)."""
        if self.state is LinkState.CLOSED:
            return
        self.state = LinkState.CLOSED
        self.error = error
        self._closing(error)
        self.events.append(Closed(error))

    def _closing(self, error: TransferdError | None) -> None:
        """What an end lets go of when it closes."""

    def _fail(self, exc: TransferdError) -> None:
        self.out.push(self.hs.data_to_send())  # a responder tells the initiator why
        self.close(self._error_of(exc))

    def _error_of(self, exc: TransferdError) -> TransferdError:
        """The error a link closes with when the peer or the handshake ended it."""
        return exc

    # -- receiving ----------------------------------------------------------------------

    def get_buffers(self) -> list[memoryview]:
        """Where the next received bytes go."""
        if self._buf is None:
            return self._decoder.get_buffers(4, PRE_AUTH_BUFFER)
        return [self._room()]

    def _room(self) -> memoryview:
        buf, view = self._buf, self._view
        assert buf is not None and view is not None
        if self._start == self._end:
            self._start = self._end = 0
        elif len(buf) - self._end < 4096 or self._start > len(buf) // 2:
            live = self._end - self._start
            view[:live] = view[self._start:self._end]
            self._start, self._end = 0, live
        return view[self._end:]

    def received(self, n: int, now: float) -> None:
        """``n`` bytes arrived in the buffers :meth:`get_buffers` gave."""
        if self._buf is None:
            self._decoder.buffer_updated(n)
            self._handshake_frames(now)
        else:
            self._end += n
            self._frames()

    def receive_message(self, data: bytes | memoryview) -> None:
        """One whole message of a message transport, after the handshake (which runs
        on a stream): exactly one frame, else BadFrame and the link is over."""
        if self._buf is None or self._start != self._end:
            self._fail(BadFrame("a message before the handshake was done"))
            return
        view = self._room()
        if len(data) > len(view):
            self._fail(BadFrame(f"a message of {len(data)} bytes is larger than any frame"))
            return
        view[:len(data)] = data
        self._end += len(data)
        self._messages = True
        try:
            self._frames()
        finally:
            self._messages = False
        if not self.closed and (self._start != self._end or self._in_frame):
            self._fail(BadFrame(f"a message of {len(data)} bytes is not one whole frame"))

    @property
    def _in_frame(self) -> bool:
        return False

    def _handshake_frames(self, now: float) -> None:
        while self.state is not LinkState.CLOSED and self._buf is None:
            try:
                frame = self._decoder.next_frame()
            except TransferdError as exc:
                self._fail(exc)
                return
            if frame is None:
                return
            self._handshake_frame(frame, now)

    def _handshake_frame(self, frame: Any, now: float) -> None:
        hs = self.hs
        if (frame.cmd == PeerCommand.PROBE and hs.role is Role.RESPONDER
                and hs.state is State.AWAIT_HELLO):
            try:
                nonce, token = parse_probe(frame.body)
            except TransferdError as exc:
                self.close(exc)
                return
            self.events.append(ProbeArrived(nonce, token))
            self.close(None)
            return
        if self.state is not LinkState.HANDSHAKE:
            self._fail(BadFrame(f"peer frame 0x{frame.cmd:02x} when {self.state.value}"))
            return
        try:
            hs.receive(frame, now)
        except TransferdError as exc:
            self._fail(exc)
            return
        self._after_handshake_step()

    def _after_handshake_step(self) -> None:
        self.out.push(self.hs.data_to_send())
        for ev in self.hs.events():
            self.events.append(ev)
            if isinstance(ev, Ready):
                self.peer = ev.peer
                self._move(LinkInput.AUTHENTICATED)
                self._authenticated()

    def _authenticated(self) -> None:
        """Past the handshake: the data phase's buffer (the exact decoder left nothing
        unread in its own)."""
        self._buf = bytearray(BUFFER)
        self._view = memoryview(self._buf)

    def _frames(self) -> None:
        raise NotImplementedError

    def send_setup(self, blob: bytes | None, error: TransferdError | None = None) -> None:
        """SETUP state: our set-up (or the error refusing theirs) to the other end."""
        if self.state is not LinkState.SETUP:
            raise BadFrame(f"peer link: a set-up when {self.state.value}")
        self.out.push(encode_setup(blob, error))

    def _setup_frames(self) -> None:
        """SETUP state: the other end's SETUP frame, when it is whole."""
        buf = self._buf
        assert buf is not None
        avail = self._end - self._start
        if avail < 8:
            return
        cmd, status, _, n = SETUP_HEAD.unpack_from(buf, self._start)
        if cmd != SETUP or n > MAX_SETUP:
            self.close(self._error_of(BadFrame(f"peer frame 0x{cmd:02x} where the "
                                               "set-up was due")))
            return
        if avail < 8 + n:
            return
        blob = bytes(buf[self._start + 8:self._start + 8 + n])
        self._start += 8 + n
        self.events.append(SetUp(b"", ack_error(1, blob)) if status else SetUp(blob, None))

    def carrier_ready(self) -> None:
        """The Domain's carrier is set up (tcp: at once): the link is READY."""
        self._move(LinkInput.CARRIER_READY)
        self._ready()

    def _ready(self) -> None:
        """Now READY (from SETUP or PAUSED)."""


class OutboundLink(_Link):
    """Our end of a link we dialled (see the module docstring).

    Parts carry a ``token`` (the Domain's: what to complete); :attr:`completions`
    collects ``(token, error or None)`` as ACKs come, and :meth:`close` hands back
    every token still owed an answer.
    """

    def __init__(self, me: PeerIdentity, rail: int, secret: bytes | None, now: float, *,
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
        # Names the link in the errors its parts fail with ("link to NODE rail R").
        self.label = label
        # Parts taken before the link was ready or while it was paused, in order.
        self._waiting: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._pending: dict[tuple[int, int], Any] = {}
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

    @property
    def stalled(self) -> bool:
        """Parts wait, or bytes are queued unsent (views of their sources held)."""
        return bool(self._waiting) or self.out.queued > 0

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
              again: bool = False) -> None:
        """Send a WRITE of ``src`` (the pages' bytes, as views: never copied)."""
        if self.state is LinkState.READY:
            self._pending[(op, part)] = token
            out = self.out
            out.push(encode_write(op, part, rkey, addrs, lens, imm, span, wid, again))
            for v in src:
                out.push(v)
            if out.queued > self.high_water:
                self._move(LinkInput.HOLD)
        elif self.state is LinkState.CLOSED:
            self.completions.append((token, self._closed_error()))
        else:
            self._waiting.append((self.write, (token, op, part, rkey, addrs, lens, src, imm,
                                               span, wid, again)))

    def send(self, token: Any, op: int, part: int, message: bytes | memoryview) -> None:
        """Send a SEND (a two-sided message); completed when the peer's client has it."""
        if self.state is LinkState.READY:
            self._pending[(op, part)] = token
            self.out.push(encode_send(op, part, len(message)))
            self.out.push(message)
            if self.out.queued > self.high_water:
                self._move(LinkInput.HOLD)
        elif self.state is LinkState.CLOSED:
            self.completions.append((token, self._closed_error()))
        else:
            self._waiting.append((self.send, (token, op, part, message)))

    def forget(self, op: int, part: int) -> Any:
        """Stop waiting for the ACK of ``(op, part)`` (its transfer ended); its token."""
        return self._pending.pop((op, part), None)

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

    # -- the peer's ACKs -------------------------------------------------------------------

    def _authenticated(self) -> None:
        # ACKs are 16 bytes (an error's message at most 4 KiB more).
        self._buf = bytearray(64 * 1024)
        self._view = memoryview(self._buf)

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
                if cmd != ACK:
                    raise BadFrame(f"peer frame 0x{cmd:02x} on a link that takes ACKs only")
                if status:
                    if mlen > MAX_ERROR_TEXT:
                        raise BadFrame(f"an ACK with a {mlen}-byte message (at most "
                                       f"{MAX_ERROR_TEXT})")
                    if end - start < 16 + mlen:
                        break
                    error = ack_error(status, buf[start + 16:start + 16 + mlen])
                    start += 16 + mlen
                else:
                    error = None
                    start += 16
                token = pending.pop((op, part), None)
                if token is not None:
                    done.append((token, error))
        except TransferdError as exc:
            self._start = start
            self.close(self._error_of(exc))
            return
        self._start = start


class InboundLink(_Link):
    """The end of a link a peer dialled (see the module docstring).

    ``landing`` holds the group's rules; ``abort`` (from any thread) is what the I/O
    side does when a region is deregistered while one of this link's writes is
    landing in it (close the link: no more of it lands).  ``max_message`` bounds a
    SEND's payload (collected in memory: refused before anything is allocated).
    ``stream_frames``: False for a link whose stream carries only the handshake and
    the set-up (verbs: writes and messages go by the NIC), where any other frame on
    it is BadFrame.
    """

    def __init__(self, me: PeerIdentity, rail: int, secret: bytes | None, now: float, *,
                 landing: Landing, timeout: float, max_message: int,
                 admit: Callable[[PeerIdentity], None] | None = None,
                 abort: Callable[[], None] | None = None, stream_frames: bool = True,
                 random: Callable[[int], bytes] | None = None) -> None:
        kw: dict[str, Any] = {} if random is None else {"random": random}
        super().__init__(PeerHandshake(Role.RESPONDER, me, rail, secret, now, timeout=timeout,
                                       admit=admit, **kw))
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
        self._nbytes = 0
        self._left = 0
        self._segs: Sequence[memoryview] = ()
        self._seg = 0
        self._pos = 0
        self._drop = False  # the payload is read and dropped (refused, or a duplicate)
        self._direct = False
        self._want = HEAD_GUESS  # bytes to read next (a header's)
        self._head = memoryview(b"")  # the buffer's first HEAD_GUESS bytes, once it has one
        # Reasons to read nothing now: ACKs unread, device landings in flight.
        self._holds = 0
        self._ack_held = False

    @property
    def reading(self) -> bool:
        """False while the link reads nothing (PAUSED, or closed)."""
        return self.state is not LinkState.PAUSED and self.state is not LinkState.CLOSED

    @property
    def _in_frame(self) -> bool:
        return self._kind != 0

    # -- receiving ----------------------------------------------------------------------

    def get_buffers(self) -> list[memoryview]:
        if self._buf is None:
            return super().get_buffers()
        start = self._start
        if start == self._end:
            if self._kind:
                if not self._drop:
                    # Straight into the pages: the rest of this payload, a socket's worth,
                    # and when that is all of it, the next frame's header into the
                    # buffer (headers go there anyway): one receive a frame while they
                    # come back to back, and a short one says the socket is empty.
                    self._direct = True
                    self._start = self._end = 0
                    segs, i = self._segs, self._seg
                    if len(segs) - i == 1:
                        return [segs[i][self._pos:], self._head]
                    first = segs[i][self._pos:]
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
            elif self._want == HEAD_GUESS:
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
        self._head = self._view[:HEAD_GUESS]

    def received(self, n: int, now: float) -> None:
        if self._direct:
            self._direct = False
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
                self._want = HEAD_GUESS
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
        if COUNTING:
            count("peer.buffered", len(data))  # (only after a header shorter than guessed)
        segs = self._segs
        i, off, pos, total = self._seg, self._pos, 0, len(data)
        if off == 0 and i == 0 and len(segs) == 1 and total == len(segs[0]):
            segs[0][:] = data  # the whole payload of a one-page write
            self._seg = 1
            return
        while pos < total:
            seg = segs[i]
            k = min(len(seg) - off, total - pos)
            seg[off:off + k] = data[pos:pos + k]
            pos += k
            off += k
            if off == len(seg):
                i += 1
                off = 0
        self._seg, self._pos = i, off

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
                self._want = HEAD_GUESS
                return
            cmd = buf[start]
            try:
                if cmd == WRITE:
                    if avail < 48:
                        self._want = HEAD_GUESS - avail
                        return
                    head = WRITE_HEAD.unpack_from(buf, start)
                    flags, npages, ext = head[1], head[2], head[7]
                    if npages == 1 and not flags & 0xF2 and not ext:
                        size = 64  # one page, no span (the small write)
                    else:
                        if flags & ~KNOWN_FLAGS or npages > MAX_PAGES or ext > MAX_EXT:
                            check_write_head(flags, npages, ext)
                        size = 48 + write_table_len(flags, npages, ext)
                    if avail < size:
                        self._want = size - avail
                        return
                    self._start = start + size
                    self._open_write(buf, start, head)
                elif cmd == SEND:
                    if avail < 24:
                        self._want = 24 - avail
                        return
                    _, _, _, part, op, plen = SEND_HEAD.unpack_from(buf, start)
                    self._start = start + 24
                    self._open_send(op, part, plen)
                else:
                    raise BadFrame(f"peer frame 0x{cmd:02x}: not a WRITE or a SEND")
            except TransferdError as exc:  # a frame whose framing cannot be trusted
                self.close(exc)
                return

    def _open_write(self, buf: bytearray, start: int, head: tuple[int, ...]) -> None:
        op, part, plen = head[4], head[3], head[9]
        self._kind, self._ref, self._nbytes, self._left = WRITE, (op, part), plen, plen
        self._seg = self._pos = 0
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
        if not plen:
            self._finish()

    def _open_send(self, op: int, part: int, plen: int) -> None:
        self._kind, self._ref, self._nbytes, self._left = SEND, (op, part), plen, plen
        self._seg = self._pos = 0
        self._adm = None
        if plen > self.max_message:
            # Collected in memory: a size only the sender vouches for is checked first.
            self._refusal = BadRequest(f"message of {plen} bytes is over the limit of "
                                       f"{self.max_message}")
            self._msg, self._segs, self._drop = None, (), True
            self._kind = -SEND
        else:
            self._refusal = None
            self._msg = bytearray(plen)
            self._segs = [memoryview(self._msg)] if plen else ()
            self._drop = False
        if not plen:
            self._finish()

    def _finish(self) -> None:
        """The frame's payload is whole: land or refuse, and answer."""
        kind, ref, nbytes = self._kind, self._ref, self._nbytes
        self._kind = 0
        if kind == WRITE:
            adm, self._adm = self._adm, None
            if adm is None:
                assert self._refusal is not None
                self.events.append(Refused(ref, self._refusal))
                self._ack(ref, self._refusal)
            elif adm.duplicate:
                adm.commit(nbytes)
                self._ack(ref, None)
            elif adm.deferred:
                self._hold()
                self.events.append(Land(adm, ref, nbytes))
            else:
                adm.commit(nbytes)
                self._ack(ref, None)
        elif kind == SEND:
            msg, self._msg = self._msg, None
            self.events.append(Deliver(self._key, bytes(msg or b""), ref))
        else:  # a refused SEND
            assert self._refusal is not None
            self._ack(ref, self._refusal)
        self._segs = ()

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
        else:
            land.admission.fail(error)
            self.events.append(Refused(land.ref, error))
        if self.state is not LinkState.CLOSED:
            self._ack(land.ref, error)
            self._release()

    def _ready(self) -> None:
        self._frames()

    def _closing(self, error: TransferdError | None) -> None:
        # What is in :attr:`out` (a refusal's reason, ACKs) may still be sent once.
        adm, self._adm = self._adm, None
        if adm is not None and self._kind:
            adm.fail(None)  # closed mid-payload: nothing of it counts; a retry may land
        self._kind = 0


__all__ = [
    "ACK_HIGH", "ACK_LOW", "BUFFER", "HEAD_GUESS", "HIGH_WATER", "LOW_WATER", "PRE_AUTH_BUFFER",
    "TRANSITIONS", "Closed", "Deliver", "Event", "InboundLink", "Land", "LinkInput",
    "LinkState", "OutboundLink", "Output", "ProbeArrived", "Refused", "SetUp",
]
