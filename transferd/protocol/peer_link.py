"""The peer link, sans-IO: what both ends of a daemon-to-daemon link share, for every
Domain.

An :class:`~.peer_outbound.OutboundLink` is our end of a link we dialled: it runs the
handshake as initiator (:mod:`.peer_handshake`), then takes parts to send and gives
back their completions when the peer's ACKs come.  An :class:`~.peer_inbound.
InboundLink` is the end of a link a peer dialled: the handshake as responder, then every
WRITE claimed, checked and landed or failed by the group's :class:`~.peer_landing.
Landing`, and acknowledged; every SEND handed on as a :class:`Deliver` event and
acknowledged when the I/O side says a client has it.  This module holds what they
share: the states and their table, the output with its watermarks, the events, and
:class:`LinkEnd` (the handshake phase, the data phase's buffer).

Bytes in, bytes out, the clock passed in; no sockets, no asyncio.  An I/O loop asks
:meth:`LinkEnd.get_buffers` where to receive (the pages of a write being received,
straight into its region, or the link's own buffer), reports what arrived with
:meth:`LinkEnd.received`, sends what :attr:`LinkEnd.out` holds and reports it with
``sent``; it drains :attr:`LinkEnd.events` (and an outbound link's ``completions``)
after each call.  A transport of whole messages feeds :meth:`LinkEnd.receive_message`
instead and sends each call's output as one message.

Link states are one enum and one transition table (:data:`TRANSITIONS`)::

    CONNECTING --connected--> HANDSHAKE --authenticated--> SETUP --carrier ready--> READY
    READY <--hold / release--> PAUSED;   any state --close--> CLOSED

SETUP is the Domain's own step after the handshake: verbs exchanges its queue pairs
there, one SETUP frame each way (:meth:`LinkEnd.send_setup`, the :class:`SetUp` event),
then says :meth:`LinkEnd.carrier_ready`; tcp's carrier is the stream itself and goes
straight on.  PAUSED is back-pressure: an outbound link whose unsent bytes passed the
high watermark takes no new part until they fall below the low one; an inbound link
whose ACKs the peer does not read (the ACK watermark), or which waits for a device
write's copies, reads nothing more until they are out.  Before the handshake is done a
link takes frames of a 4 KiB body and no payload, into an 8 KiB buffer, for at most the
handshake's timeout.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from .errors import BadFrame, TransferdError
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
from .peer_landing import Admission
from .peer_wire import (
    MAX_SETUP,
    SETUP,
    SETUP_HEAD,
    ack_error,
    encode_setup,
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
# Inbound: answers to READs (views of regions, no copies) unsent above READ_HIGH stop
# reading until READ_LOW: a peer that asks without taking the answers holds back
# itself; below it the answers stay deep enough to keep the socket busy.
READ_HIGH = 16 * 1024 * 1024
READ_LOW = 4 * 1024 * 1024


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

    def extend(self, views: Sequence[memoryview], nbytes: int) -> None:
        """Push ``views`` (``nbytes`` in all) at once: a READ's answer, thousands of pages
        (empty ones left out, as :meth:`push` leaves them)."""
        self._q.extend(filter(None, views))
        self.queued += nbytes

    def views(self, max_bytes: int = SEND_BYTES) -> list[memoryview | bytes]:
        """What to offer the next send: the first views, up to ``max_bytes``."""
        q = self._q
        if len(q) == 1:
            return [q[0]]
        if self.queued <= max_bytes and len(q) <= IOV_MAX:
            return list(q)  # all of it (a paged write's header and pages): no walk
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
        q = self._q
        if n == self.queued:
            q.clear()  # all of it went (the usual send): no walk over its views
            self.queued = 0
            return
        self.queued -= n
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
    # The sender's W3C trace id (26 bytes), when its SEND carried one (TX_EXT).
    trace: bytes | None = None


@dataclass(frozen=True, slots=True)
class Land:
    """A WRITE into memory reached through staging was received: run
    ``admission.land`` and then :meth:`InboundLink.landed` (the link reads nothing
    meanwhile)."""

    admission: Admission
    ref: tuple[int, int]
    nbytes: int
    opened: float = 0.0  # the link's clock when its header came (a landing's span)


@dataclass(frozen=True, slots=True)
class SetUp:
    """The other end's set-up came (SETUP state): ``blob``, or ``error`` if it refused
    ours."""

    blob: bytes
    error: TransferdError | None


@dataclass(frozen=True, slots=True)
class Refused:
    """A WRITE (or a READ) was refused (its answer carries ``error``): for the log (with
    the part's trace id, if it carried one)."""

    ref: tuple[int, int]
    error: TransferdError
    trace: bytes | None = None
    what: str = "write"


@dataclass(frozen=True, slots=True)
class Incoming:
    """A WRITE being received now (for what is in flight): its (op, part), who sent it,
    bytes in of its payload, its trace id, since when (the clock the link was fed).
    With ``kind`` "read": a peer's READ being answered here, ``received`` the bytes of
    its answer sent so far (into the kernel), ``since`` when the READ was taken."""

    ref: tuple[int, int]
    peer: Peer
    rail: int
    received: int
    nbytes: int
    trace: bytes | None
    since: float
    kind: str = "write"
    # Who asked (the I/O side's name for the link's other end: its host:port).
    owner: str = ""


@dataclass(frozen=True, slots=True)
class Placed:
    """A traced WRITE landed and counted, or a traced READ was answered (for the log:
    the receiver's, or responder's, record of a traced transfer); only parts that carry
    a trace id make one."""

    ref: tuple[int, int]
    nbytes: int
    trace: bytes
    # The link's clock when its header came (where a landing's span starts).
    opened: float | None = None
    # "write" (landed), or "read": a traced READ answered (its bytes handed to the link).
    what: str = "write"


@dataclass(frozen=True, slots=True)
class StageRead:
    """A READ of memory reached through staging (device memory) was admitted: run
    ``source.land`` (its bytes into staging), then :meth:`InboundLink.staged` (the link
    reads nothing meanwhile)."""

    source: Any
    ref: tuple[int, int]
    nbytes: int
    # The READ asked for its answer's checksum (RX_CRC); its trace id.
    crc: bool = False
    trace: bytes | None = None


@dataclass(frozen=True, slots=True)
class ReadsServed:
    """The link answered its first READ: from now on it sends bulk data back, not only
    ACKs (tcp gives its socket a send buffer for that)."""


@dataclass(frozen=True, slots=True)
class Closed:
    """The link is over; ``error`` says why (None: closed on purpose)."""

    error: TransferdError | None


Event = (Probe | Ready | ProbeArrived | Deliver | Land | SetUp | Refused | Placed
         | ReadsServed | StageRead | Closed)


class LinkEnd:
    """What both ends of a link share: the state, the handshake phase, the output,
    the data phase's buffer (see :mod:`.peer_outbound`, :mod:`.peer_inbound`)."""

    def __init__(self, hs: PeerHandshake) -> None:
        self.hs = hs
        self.state = LinkState.CONNECTING if hs.role is Role.INITIATOR else LinkState.HANDSHAKE
        self.peer: PeerIdentity | None = None
        self.error: TransferdError | None = None
        self.out = Output()
        self.events: list[Event] = []
        #: The handshake failed (refused, timed out, a frame it cannot take), as the
        #: I/O side reports it (transferd.authlog); not a dial that never connected.
        self.handshake_failed = False
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
        if self.state is LinkState.HANDSHAKE:
            self.handshake_failed = True  # (its reason is the handshake's: hs.reason)
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
        if not self.closed and (self._start != self._end or self.in_frame):
            self._fail(BadFrame(f"a message of {len(data)} bytes is not one whole frame"))

    @property
    def in_frame(self) -> bool:
        """In the middle of a frame's payload (more of it is due)."""
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


def scatter_into(segs: Sequence[memoryview], i: int, off: int,
                 data: memoryview) -> tuple[int, int]:
    """Copy ``data`` (payload bytes that came in a link's buffer) into ``segs`` from
    segment ``i`` at ``off``; where the next byte goes.  The caller checked that the
    segments have room (a frame's payload length is its segments' sum)."""
    pos, total = 0, len(data)
    while pos < total:
        seg = segs[i]
        k = min(len(seg) - off, total - pos)
        seg[off:off + k] = data[pos:pos + k]
        pos += k
        off += k
        if off == len(seg):
            i += 1
            off = 0
    return i, off


__all__ = [
    "ACK_HIGH",
    "ACK_LOW",
    "BUFFER",
    "HEAD_GUESS",
    "HIGH_WATER",
    "LOW_WATER",
    "PRE_AUTH_BUFFER",
    "READ_HIGH",
    "READ_LOW",
    "TRANSITIONS",
    "Closed",
    "Deliver",
    "Event",
    "Incoming",
    "Land",
    "LinkEnd",
    "LinkInput",
    "LinkState",
    "Output",
    "Placed",
    "ProbeArrived",
    "ReadsServed",
    "Refused",
    "SetUp",
    "StageRead",
    "scatter_into",
]
