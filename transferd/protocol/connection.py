"""Sans-IO RPC connections: the server side and the client side, for a connection's whole life.

Each side is a state machine over :class:`Phase` with one explicit transition table
(:data:`SERVER_TRANSITIONS`, :data:`CLIENT_TRANSITIONS`; h11's ``_state.py`` is the model):
the handshake (HELLO, AUTH, a held verdict), the data phase (IDLE, and on the server
RUNNING while a request runs), CLOSING and CLOSED.  :class:`ConnState` is the coarse view
callers read (``HELLO -> AUTH -> READY -> CLOSING -> CLOSED``; IDLE and RUNNING are READY).
An input the table does not allow is a typed error, :class:`IllegalTransition`.

No sockets, no asyncio, no clock of its own: bytes go into :attr:`decoder` (an I/O
layer's ``get_buffer`` / ``buffer_updated`` go straight to it, so payloads land in
their destination), the time is passed in (``now``), and every frame to write comes out
as an :class:`Outgoing` (header and body from the one encoder,
:func:`~transferd.protocol.frames.encode_head`, then payload views sent from where they
lie) from :meth:`take_output`, or as bytes from :meth:`data_to_send`.

**Server.**  :meth:`ServerConnection.next_event` is the request gate: it hands out the
next request (a :class:`~transferd.protocol.frames.Frame`) only while the connection is
IDLE (the request before it was answered: frames run one at a time, in order, so a
later payload never lands in memory an earlier command still reads) and its output is
not blocked (:meth:`output_blocked`: the I/O layer's write buffer is over its mark).
Before READY it applies PROTOCOL.md's pre-auth limits from the header alone
(:meth:`check_header`, the decoder's gate): HELLO first (else NO_HELLO), then AUTH where
due (else UNAUTHORIZED), at most 4096 bytes of body and no payload (else TOO_LARGE).
Once READY every request is checked before its handler sees it (flags, a command this
server serves at its minor, the per-command caps the decoder enforced) and answered
through :meth:`answer` or :meth:`fail` (REPLY, REPLY|ERROR, or for a NO_REPLY command
nothing / EVENT|ERROR); :meth:`event` sends EVENT frames unasked.  A fatal error goes
CLOSING.  With ``verdicts`` (the daemon's pre-auth admission, ``transferd/preauth.py``)
a wrong secret's answer waits its source's turn and a good token waits behind failures
still unanswered, never past the handshake deadline (then TIMEOUT): :attr:`timer_at`
says when to call :meth:`handle_timeout`.

**Client.**  :meth:`ClientConnection.start` queues HELLO; replies drive the handshake
(AUTH with hmac-sha256, the server's proof checked: a client holding a secret refuses a
server that does not prove it knows it).  Once READY :meth:`ClientConnection.request`
encodes a request (requests pipeline: no gate on this side) and registers it by seq;
:meth:`ClientConnection.next_event` turns each frame that arrives into an
:class:`Answer` to its request, a :class:`Notice` (an EVENT frame) or a
:class:`Refused`.  No frame over the server's announced limits is sent.

``receive_data`` on either side is a copying convenience for tests and simple callers:
it decodes everything it is given and returns the events (a server hands out every
complete request without waiting for answers: the caller runs them in order).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from . import auth
from .constants import (
    COMMAND_MINOR,
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_PAYLOAD,
    HELLO_MAX_BODY,
    PROTO_MAJOR,
    PROTO_PATCH,
    Command,
    Flag,
    command_name,
)
from .errors import (
    BadFrame,
    BadRequest,
    ConnectionLost,
    Internal,
    NoHello,
    OverLimit,
    ProtocolError,
    Timeout,
    TooLarge,
    TransferdError,
    Unauthorized,
    UnknownCommand,
    VersionMismatch,
    error_from_body,
    untraced,
)
from .frames import DISCARD, Frame, FrameDecoder, RawHeader, Sink, encode_head
from .frames import Phase as _DecoderPhase
from .keyring import Keyring
from .messages import str_field, uint_field

# The decoder's buffer before READY: a header and the largest pre-auth body.
HANDSHAKE_BUFFER = 8192


class ConnState(enum.Enum):
    """The coarse state callers read (each :class:`Phase` maps to one)."""

    HELLO = "hello"  # waiting for HELLO (server) or its reply (client)
    AUTH = "auth"  # the challenge is out (or a verdict is held): not yet READY
    READY = "ready"
    CLOSING = "closing"  # a fatal error was sent (or received); the transport closes
    CLOSED = "closed"


class Phase(enum.IntEnum):
    """Where a connection is; the transition tables are over these."""

    HELLO = 0
    AUTH = 1
    VERDICT = 2  # server: a good secret's answer is held (its source's failures wait)
    IDLE = 3  # READY, nothing running: the next request may go out
    RUNNING = 4  # server: READY, a request is running; the frames behind it wait
    CLOSING = 5
    CLOSED = 6


STATE_OF: dict[Phase, ConnState] = {
    Phase.HELLO: ConnState.HELLO,
    Phase.AUTH: ConnState.AUTH,
    Phase.VERDICT: ConnState.AUTH,
    Phase.IDLE: ConnState.READY,
    Phase.RUNNING: ConnState.READY,
    Phase.CLOSING: ConnState.CLOSING,
    Phase.CLOSED: ConnState.CLOSED,
}


class Input(enum.IntEnum):
    HELLO_ACCEPTED = 0  # no authentication due, or the token was good
    CHALLENGED = 1  # hmac-sha256: the challenge (server) / AUTH (client) is out
    AUTH_ACCEPTED = 2
    HELD = 3  # server: the good verdict waits for its turn
    RELEASED = 4  # server: ...and goes out now
    REQUEST = 5  # server: a request was handed out
    ANSWERED = 6  # server: its answer went out (or it was one-way and done)
    ENDED = 7  # the other side half-closed and everything it sent ran
    REFUSED = 8  # a fatal error went out (server) or came in (client)
    TIMED_OUT = 9
    CLOSE = 10  # this side closes (the drain at SIGTERM, a slot that gave way)
    LOST = 11  # the transport is gone


_P = Phase
_I = Input

# phase -> {input: next phase}; anything else is IllegalTransition.
SERVER_TRANSITIONS: dict[Phase, dict[Input, Phase]] = {
    _P.HELLO: {
        _I.HELLO_ACCEPTED: _P.IDLE, _I.CHALLENGED: _P.AUTH, _I.HELD: _P.VERDICT,
        _I.REFUSED: _P.CLOSING, _I.TIMED_OUT: _P.CLOSING, _I.CLOSE: _P.CLOSING,
        _I.LOST: _P.CLOSED,
    },
    _P.AUTH: {
        _I.AUTH_ACCEPTED: _P.IDLE, _I.REFUSED: _P.CLOSING, _I.TIMED_OUT: _P.CLOSING,
        _I.CLOSE: _P.CLOSING, _I.LOST: _P.CLOSED,
    },
    _P.VERDICT: {
        _I.RELEASED: _P.IDLE, _I.REFUSED: _P.CLOSING, _I.TIMED_OUT: _P.CLOSING,
        _I.CLOSE: _P.CLOSING, _I.LOST: _P.CLOSED,
    },
    _P.IDLE: {
        _I.REQUEST: _P.RUNNING, _I.ENDED: _P.CLOSING, _I.REFUSED: _P.CLOSING,
        _I.CLOSE: _P.CLOSING, _I.LOST: _P.CLOSED,
    },
    _P.RUNNING: {
        _I.ANSWERED: _P.IDLE, _I.REFUSED: _P.CLOSING, _I.CLOSE: _P.CLOSING,
        _I.LOST: _P.CLOSED,
    },
    # A request that was running when the connection began to close may still end:
    # its answer is dropped.
    _P.CLOSING: {
        _I.REFUSED: _P.CLOSING, _I.TIMED_OUT: _P.CLOSING, _I.ANSWERED: _P.CLOSING,
        _I.CLOSE: _P.CLOSING, _I.LOST: _P.CLOSED,
    },
    _P.CLOSED: {_I.LOST: _P.CLOSED},
}

CLIENT_TRANSITIONS: dict[Phase, dict[Input, Phase]] = {
    _P.HELLO: {
        _I.HELLO_ACCEPTED: _P.IDLE, _I.CHALLENGED: _P.AUTH, _I.REFUSED: _P.CLOSING,
        _I.TIMED_OUT: _P.CLOSING, _I.CLOSE: _P.CLOSING, _I.LOST: _P.CLOSED,
    },
    _P.AUTH: {
        _I.AUTH_ACCEPTED: _P.IDLE, _I.REFUSED: _P.CLOSING, _I.TIMED_OUT: _P.CLOSING,
        _I.CLOSE: _P.CLOSING, _I.LOST: _P.CLOSED,
    },
    # READY: requests pipeline (the server runs them in order); a fatal error closes.
    _P.IDLE: {_I.REFUSED: _P.CLOSING, _I.CLOSE: _P.CLOSING, _I.LOST: _P.CLOSED},
    _P.CLOSING: {_I.REFUSED: _P.CLOSING, _I.CLOSE: _P.CLOSING, _I.LOST: _P.CLOSED},
    _P.CLOSED: {_I.LOST: _P.CLOSED},
}


def _project(*tables: dict[Phase, dict[Input, Phase]]) -> dict[ConnState, dict[Input, ConnState]]:
    out: dict[ConnState, dict[Input, ConnState]] = {}
    for table in tables:
        for phase, row in table.items():
            proj = out.setdefault(STATE_OF[phase], {})
            for inp, nxt in row.items():
                proj[inp] = STATE_OF[nxt]
    return out


# Both tables seen through ConnState (what a caller of either side can observe).
TRANSITIONS: dict[ConnState, dict[Input, ConnState]] = _project(SERVER_TRANSITIONS,
                                                                CLIENT_TRANSITIONS)


class IllegalTransition(Internal):
    """An input the transition table does not allow in the current phase (a bug)."""


# -- events and output ------------------------------------------------------------------


@dataclass
class Ready:
    """The handshake is done: requests may flow."""

    client: str = ""  # server side: the client's name from HELLO
    minor: int = 0  # the minor the other side reported
    method: str | None = None  # how it authenticated (None: nothing was required)
    hello: dict[str, Any] = field(default_factory=dict)  # client side: the HELLO reply


@dataclass
class Refused:
    """A fatal error: sent (server) or received (client); the connection closes.

    ``auth`` is true for a failed authentication (a wrong or missing secret).
    ``guess`` is true where a secret was presented and checked and was wrong (a
    token, a mac): the server logs it with the source and, given ``verdicts``,
    answers it at ``answer_at`` (None: not before the deadline, so TIMEOUT then;
    ``failures``: its source's in the window).  A HELLO without credentials, or
    with a malformed mac, tells a guesser nothing about the secret: answered at once.
    ``reason`` says why, for the log and the metrics (``no_secret``,
    ``wrong_secret``, ``timeout``, ``protocol``: transferd.authlog.REASONS); it is
    set for every failure of the authentication step, ``auth`` or not (an AUTH
    that never came is closed at once, not slowed down).
    """

    error: TransferdError
    auth: bool = False
    guess: bool = False
    answer_at: float | None = None
    failures: int = 0
    reason: str = ""


@dataclass
class Request:
    """Server side, READY (``receive_data`` only): a request frame for the handlers."""

    frame: Frame


class Answer(NamedTuple):
    """Client side: the reply to a request (``error`` set for an error reply)."""

    token: Any  # what the caller registered with the request
    frame: Frame
    error: TransferdError | None


class Notice(NamedTuple):
    """Client side: an EVENT frame (``error`` set for EVENT|ERROR: a one-way failure)."""

    frame: Frame
    error: TransferdError | None


HandshakeEvent = Ready | Refused
Event = Ready | Refused | Request


class Outgoing(NamedTuple):
    """One frame to write: ``head`` (header and body), then ``payload`` views of
    ``payload_len`` bytes in all, sent from where they lie; ``hold`` are keep-alives of
    that memory (anything with ``release()``), released by the I/O layer once the bytes
    are out; ``fds`` ride with the frame's first byte where the transport carries them."""

    head: bytes
    payload: Sequence[Any] = ()
    payload_len: int = 0
    hold: Sequence[Any] = ()
    fds: Sequence[int] = ()


class Flow(enum.Enum):
    """The outbound half: whether the I/O layer can take more frames now."""

    OPEN = "open"
    BLOCKED = "blocked"  # the transport's write buffer is over its mark


class Inbound(enum.Enum):
    """The inbound half: whether the other side may still send."""

    OPEN = "open"
    ENDED = "ended"  # it half-closed: what it sent runs, then the connection closes


class Verdicts(Protocol):
    """When the answer to a handshake's verdict may go out (the server's pre-auth
    admission for this connection; ``transferd.preauth.Admission.verdicts``)."""

    def failed(self, now: float) -> tuple[float | None, int]: ...

    def success_at(self, now: float) -> float | None: ...


class _Machine:
    role = "?"
    table: dict[Phase, dict[Input, Phase]] = {}

    def __init__(self) -> None:
        self.phase = Phase.HELLO
        self.state = ConnState.HELLO
        # The frames this side queued itself (the handshake, refusals, timeouts); the
        # answers to requests are returned by the methods that make them instead.
        self.out: list[Outgoing] = []

    def _go(self, inp: Input) -> None:
        nxt = self.table[self.phase].get(inp)
        if nxt is None:
            raise IllegalTransition(
                f"{self.role} connection: {inp.name.lower()} in phase {self.phase.name.lower()}"
            )
        self.phase = nxt
        self.state = STATE_OF[nxt]

    def take_output(self) -> list[Outgoing]:
        """The frames to write, in order (the I/O layer writes each and releases its hold)."""
        out, self.out = self.out, []
        return out

    def frames_to_send(self) -> list[bytes]:
        """Each frame to write as one bytes (a copy of its payload; tests, handshakes)."""
        return [o.head + b"".join(o.payload) if o.payload_len else o.head
                for o in self.take_output()]

    def data_to_send(self) -> bytes:
        """Every frame to write, as bytes (empty when none)."""
        return b"".join(self.frames_to_send())

    def close(self) -> None:
        """This side closes (nothing more is read; what is queued still goes out)."""
        if self.phase is not Phase.CLOSED and self.phase is not Phase.CLOSING:
            self._go(Input.CLOSE)

    def connection_lost(self) -> None:
        self._go(Input.LOST)


# -- a failed request ----------------------------------------------------------------------

_NO_REPLY_FLAG = int(Flag.NO_REPLY)
_REPLY_ERROR_FLAGS = int(Flag.REPLY | Flag.ERROR)
_EVENT_ERROR_FLAGS = int(Flag.EVENT | Flag.ERROR)


def failure_frame(request_flags: int, exc: TransferdError) -> tuple[int, bool]:
    """The flags of the frame that answers a failed request, and whether the connection
    then closes: REPLY|ERROR, except that a NO_REPLY command's non-fatal failure goes out
    unasked as EVENT|ERROR (the client raises it at its next flush point) and the
    connection keeps serving.  A fatal error is REPLY|ERROR and closes, NO_REPLY or not.
    """
    if request_flags & _NO_REPLY_FLAG and not exc.fatal:
        return _EVENT_ERROR_FLAGS, False
    return _REPLY_ERROR_FLAGS, exc.fatal


# -- server ---------------------------------------------------------------------------------


@dataclass
class ServerSettings:
    """What one listener's connections answer and require."""

    minor: int = 2
    name: str = "transferd"
    features: list[str] = field(default_factory=list)
    max_body: int = 4 * 1024 * 1024
    max_payload: int = 1 << 34
    # The shared secret (b"": no authentication required), and during a rotation
    # the one clients proved before (accepted too, and proved as ``previous_proof``).
    secret: bytes = b""
    previous_secret: bytes = b""
    # Whether this listener offers the token method (the token crosses the wire).
    token_allowed: bool = False
    # Message transports announce their continuation size in HELLO.
    max_message: int | None = None
    handshake_timeout: float = 5.0
    # Per-request caps announced in HELLO besides max_body / max_payload
    # (max_tensors, max_reply): the session enforces them.
    limits: dict[str, int] = field(default_factory=dict)
    # The commands this server has handlers for (None: every command of its minor).
    served: Container[int] | None = None

    @property
    def methods(self) -> list[str]:
        if not self.secret:
            return []
        return [auth.HMAC_SHA256, auth.TOKEN] if self.token_allowed else [auth.HMAC_SHA256]


_HELLO = int(Command.HELLO)
_AUTH = int(Command.AUTH)
_REPLY = int(Flag.REPLY)
_EVENT = int(Flag.EVENT)
_ERROR = int(Flag.ERROR)
_NO_REPLY = int(Flag.NO_REPLY)
_REPLY_ERROR = int(Flag.REPLY | Flag.ERROR)
_NOT_REQUEST = int(Flag.REPLY | Flag.ERROR | Flag.EVENT)
_NOT_PLAIN = 0xFF & ~_NO_REPLY  # any flag but NO_REPLY: the checked path
# A NamedTuple made without its Python __new__ (once per frame on the hot path).
_mk = tuple.__new__
_BATCHES = (int(Command.GET_TENSORS), int(Command.SET_TENSORS))
_COMMANDS: dict[int, Command] = {int(c): c for c in Command}

# Module-level aliases for the per-frame path (``Phase.X`` is an attribute lookup
# through the enum's metaclass).
_HELLO_P, _AUTH_P, _VERDICT_P = Phase.HELLO, Phase.AUTH, Phase.VERDICT
_IDLE, _RUNNING, _CLOSING_P, _CLOSED_P = Phase.IDLE, Phase.RUNNING, Phase.CLOSING, Phase.CLOSED
_READY_S = ConnState.READY
_OPEN, _BLOCKED = Flow.OPEN, Flow.BLOCKED
_ENDED = Inbound.ENDED
_S_ROWS = {p: row for p, row in SERVER_TRANSITIONS.items()}
_TO_RUNNING = SERVER_TRANSITIONS[_IDLE][Input.REQUEST]
_TO_IDLE = SERVER_TRANSITIONS[_RUNNING][Input.ANSWERED]


class ServerConnection(_Machine):
    """The server's side of one connection (see the module docstring)."""

    role = "server"
    table = SERVER_TRANSITIONS

    def __init__(
        self,
        settings: ServerSettings,
        now: float,
        *,
        random: Callable[[int], bytes] = os.urandom,
        payload_sink: Callable[[Frame], Sink] | None = None,
        verdicts: Verdicts | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.now = now
        self.deadline = now + settings.handshake_timeout
        self._random = random
        # The pre-auth admission's verdict timing (None: every verdict answered at once).
        self.verdicts = verdicts
        # The dispatcher's sink: where a checked request's payload goes.
        self._dispatch_sink = payload_sink
        self.decoder = FrameDecoder(
            max_body=auth.PRE_AUTH_MAX_BODY,
            max_payload=0,
            payload_sink=self._sink,
            buffer_size=HANDSHAKE_BUFFER,
        )
        self.decoder.gate = self.check_header
        if "max_tensors" in settings.limits:  # a longer batch is refused, not decoded
            self.decoder.array_caps = dict.fromkeys(_BATCHES, settings.limits["max_tensors"])
        self.flow = Flow.OPEN
        self.inbound = Inbound.OPEN
        self.client_name = ""
        self.client_minor = 0
        self.method: str | None = None
        self._nonce = b""
        self._challenge = b""
        # The secrets of this handshake, taken at HELLO: a reload meanwhile
        # changes the next handshake, not this one.
        self._keys = Keyring()
        # The handshake frame being answered (cmd, seq): a held verdict's answer names it.
        self._hs = (_HELLO, 0)
        # Handshake frames next_event took (HELLO, AUTH: two at most), for the I/O
        # layer's counts; it empties the list.
        self.handshake_frames: list[Frame] = []
        # A held verdict: the frames of its answer, when they go out (None: not before
        # the deadline, TIMEOUT then), and the Ready a held success becomes.
        self._held: list[Outgoing] | None = None
        self._held_at: float | None = None
        self._held_ready: Ready | None = None
        # Requests this server runs at its minor (the fast check; anything else is
        # judged on the slow path, which names what is wrong).
        served = settings.served
        self._runnable = frozenset(
            int(c) for c in Command
            if c is not Command.AUTH and COMMAND_MINOR[c] <= settings.minor
            and (served is None or c in served)
        )

    # -- the I/O layer's view ----------------------------------------------------------

    @property
    def wants_read(self) -> bool:
        """Whether bytes should be read now: before READY always, once READY only while
        the gate is open (IDLE, output not blocked, the other side still sending)."""
        p = self.phase
        if p is _IDLE:
            return self.flow is _OPEN and self.inbound is not _ENDED
        return p is _HELLO_P or p is _AUTH_P

    @property
    def should_close(self) -> bool:
        """CLOSING with nothing held back: the I/O layer writes what is queued and closes."""
        return self.phase is _CLOSING_P and self._held is None

    @property
    def timer_at(self) -> float | None:
        """When :meth:`handle_timeout` has something to do (None: nothing pending)."""
        if self._held is not None:
            return self._held_at if self._held_at is not None else self.deadline
        if self.phase is _HELLO_P or self.phase is _AUTH_P:
            return self.deadline
        return None

    def close(self) -> None:
        """This side closes: a held verdict is not answered; what is queued still goes."""
        self._held, self._held_at, self._held_ready = None, None, None
        super().close()

    def connection_lost(self) -> None:
        self._held, self._held_at, self._held_ready = None, None, None
        super().connection_lost()

    def detach(self) -> None:
        """The transport is gone and no byte comes in again: let go of the I/O layer's
        objects (its payload sink, the admission's verdicts) and of the decoder's sink,
        a method of this connection. Each was a reference cycle (the I/O layer holds this
        connection, the decoder is held by it) that only the cyclic collector frees:
        about 30 objects per closed connection, kept until its next full pass."""
        self._dispatch_sink = None
        self.verdicts = None
        self.decoder._sink_factory = None

    def output_blocked(self) -> None:
        """The I/O layer's write buffer is over its mark: no request goes out meanwhile."""
        self.flow = _BLOCKED

    def output_drained(self) -> None:
        self.flow = _OPEN

    def eof(self) -> bool:
        """The other side half-closed.  True: what it sent still runs (READY); False:
        nothing will (close now)."""
        if self.state is not _READY_S:
            return False
        self.inbound = _ENDED
        return True

    # -- input ------------------------------------------------------------------------

    def check_header(self, h: RawHeader) -> None:
        """The pre-auth gate: judge a frame from its header alone (raises)."""
        if h.magic != b"TD" or h.reserved or h.flags & ~0x0F:
            return  # the decoder's own checks name the fault (BAD_FRAME)
        phase = self.phase
        if phase is _HELLO_P:
            if h.cmd != _HELLO:
                raise NoHello("the first frame of a connection must be HELLO", seq=h.seq)
            what = "HELLO"
        elif phase is _AUTH_P:
            if h.cmd != _AUTH:
                raise Unauthorized(
                    "AUTH is due (hmac-sha256): nothing else is served before it", seq=h.seq
                )
            what = "AUTH"
        else:
            return
        if h.body_len > auth.PRE_AUTH_MAX_BODY:
            raise TooLarge(
                f"{what} body of {h.body_len} bytes: at most {auth.PRE_AUTH_MAX_BODY} before "
                "authentication", seq=h.seq,
            )
        if h.payload_len:
            raise TooLarge(f"{what} carries no payload (announced {h.payload_len})", seq=h.seq)

    def next_event(self, now: float | None = None) -> Frame | Ready | Refused | None:
        """The request gate: the next request to run (a Frame), a handshake event, or None
        (nothing complete, a request running, output blocked, a verdict held, closing).

        A request that fails its checks comes out with ``refused`` set (why it may not
        run): the caller answers it with ``fail(frame, frame.refused)``.  A broken stream
        is refused (fatal) and goes CLOSING.
        """
        if now is not None:
            self.now = now
        d = self.decoder
        while True:
            phase = self.phase
            if phase is _IDLE:
                if self.flow is _BLOCKED:
                    return None
                if d._start == d._end and d.phase is _D_HEADER:  # nothing buffered
                    if self.inbound is _ENDED:
                        self._go(Input.ENDED)
                    return None
                try:
                    f = d.next_frame()
                except ProtocolError as exc:
                    return self._broken(exc)
                if f is None:
                    if self.inbound is _ENDED:
                        self._go(Input.ENDED)
                    return None
                if f.flags & _NOT_PLAIN or f.cmd not in self._runnable or f.refused is not None:
                    # Handed out all the same, with why it may not run: the caller
                    # answers it with fail(f, f.refused) (and counts it, logs it).
                    f.refused = self._refusal(f)
                self.phase = _TO_RUNNING  # SERVER_TRANSITIONS[IDLE][REQUEST]
                return f
            if phase is _HELLO_P or phase is _AUTH_P:
                try:
                    f = d.next_frame()
                except ProtocolError as exc:
                    return self._broken(exc)
                if f is None:
                    return None
                self._hs = (f.cmd, f.seq)
                self.handshake_frames.append(f)
                events = self._hello(f) if phase is _HELLO_P else self._auth(f)
                if events:
                    return events[0]
                continue
            return None

    def _broken(self, exc: ProtocolError) -> Refused:
        return self.broken(exc)

    def broken(self, exc: ProtocolError) -> Refused:
        """The stream broke the framing rules (the decoder, a message transport): the
        fatal error goes out and the connection goes CLOSING."""
        (ev,) = self.refuse(exc, self.decoder.current_cmd, exc.seq or 0)
        assert isinstance(ev, Refused)
        return ev

    def _refusal(self, f: Frame) -> TransferdError | None:
        """Why a READY frame may not run (None: it may)."""
        if f.flags & _NOT_REQUEST:
            return BadRequest("a request must not carry REPLY, ERROR or EVENT flags", seq=f.seq)
        if f.refused is not None:  # the sink's error, or a cap the decoder enforced
            return f.refused
        cmd = _COMMANDS.get(f.cmd)
        if cmd is None:
            return UnknownCommand(f"unknown command 0x{f.cmd:02x}", seq=f.seq)
        if COMMAND_MINOR[cmd] > self.settings.minor:
            return UnknownCommand(
                f"{cmd.name} needs protocol minor {COMMAND_MINOR[cmd]}; this server speaks "
                f"{PROTO_MAJOR}.{self.settings.minor}", seq=f.seq)
        if cmd is Command.AUTH:
            return BadRequest("AUTH: this connection is already authenticated", seq=f.seq)
        if f.cmd not in self._runnable:
            return UnknownCommand(f"{cmd.name} is not served by this daemon", seq=f.seq)
        return None

    def _sink(self, frame: Frame) -> Sink:
        """Where a payload goes: checked first, then the dispatcher's sink; a refusal is
        recorded on the frame (``refused``) and its payload read and dropped."""
        try:
            if self.state is not _READY_S:
                raise NoHello("the first frame of a connection must be HELLO")
            if frame.flags & _NOT_PLAIN or frame.cmd not in self._runnable or \
                    frame.refused is not None:
                err = self._refusal(frame)
                if err is not None:
                    raise err
            if self._dispatch_sink is None:
                return None
            return self._dispatch_sink(frame)
        except TransferdError as exc:
            frame.refused = untraced(exc)  # (kept on the frame: no frame cycle)
            return DISCARD

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """Bytes in (a copying convenience: every complete frame is decoded now and its
        events returned, requests included, without waiting for their answers)."""
        events: list[Event] = []
        src = memoryview(data).cast("B")
        d = self.decoder
        while True:
            # Frame by frame: the gate judges each header in the state that
            # the frames before it left.
            while self.phase is not _CLOSING_P and self.phase is not _CLOSED_P:
                try:
                    f = d.next_frame()
                except ProtocolError as exc:
                    return events + self.refuse(exc, d.current_cmd, exc.seq or 0)
                if f is None:
                    break
                events += self.receive_frame(f)
            if not len(src) or self.phase is _CLOSING_P or self.phase is _CLOSED_P:
                return events
            dst = d.get_buffer(len(src))
            n = min(len(dst), len(src))
            dst[:n] = src[:n]
            src = src[n:]
            d.buffer_updated(n)

    def receive_frame(self, frame: Frame) -> list[Event]:
        phase = self.phase
        if phase is _IDLE or phase is _RUNNING:
            return [Request(frame)]  # unchecked: next_event is the gate that checks
        self._hs = (frame.cmd, frame.seq)
        if phase is _HELLO_P:
            return list(self._hello(frame))
        if phase is _AUTH_P:
            return list(self._auth(frame))
        return []  # VERDICT / CLOSING / CLOSED: nothing more is read

    def handle_timeout(self, now: float) -> list[HandshakeEvent]:
        """Call at (or after) :attr:`timer_at`: a held answer goes out, or a handshake that
        did not finish (or whose verdict could not be answered in time) gets TIMEOUT."""
        self.now = now
        if self._held is not None:
            if self._held_at is not None and now >= self._held_at:
                held, ready = self._held, self._held_ready
                self._held, self._held_at, self._held_ready = None, None, None
                self.out += held
                if ready is not None:
                    self._go(Input.RELEASED)
                    self._promote()
                    return [ready]
                return []
            if self._held_at is None and now >= self.deadline:
                return self._time_out()
            return []
        if (self.phase is not _HELLO_P and self.phase is not _AUTH_P) or now < self.deadline:
            return []
        return self._time_out()

    def _time_out(self, why: str = "") -> list[HandshakeEvent]:
        held = self._held is not None
        self._held, self._held_at, self._held_ready = None, None, None
        cmd, seq = self._hs if held or why else (
            (_HELLO, 0) if self.phase is _HELLO_P else (_AUTH, 0))
        name = "HELLO" if cmd == _HELLO else "AUTH"
        if why:
            exc = Timeout(f"no verdict within the handshake timeout: {why}")
        elif held:
            # The same answer for a good secret and a bad one: it tells a guesser nothing.
            exc = Timeout(
                f"no verdict within the handshake timeout "
                f"({self.settings.handshake_timeout:g} s): the failed attempts of this "
                "source are answered one after another")
        else:
            exc = Timeout(f"{name} did not arrive within "
                          f"{self.settings.handshake_timeout:g} s")
        self.out.append(Outgoing(encode_head(cmd, _REPLY_ERROR, seq if held or why else 0,
                                              exc.to_body(), 0)))
        self._go(Input.TIMED_OUT)
        return [Refused(exc, reason="timeout" if cmd == _AUTH and not why else "")]

    def give_way(self, why: str) -> list[HandshakeEvent]:
        """The pre-auth slot was taken back (a newer connection needed it): TIMEOUT saying
        why, whatever verdict was held, then close."""
        if self.phase is _CLOSED_P or self.state is _READY_S:
            return []
        if self.phase is _CLOSING_P and self._held is None:
            return []
        return self._time_out(why)

    def refuse(self, exc: TransferdError, cmd: int, seq: int, *, is_auth: bool = False,
               guess: bool = False, reason: str = "") -> list[HandshakeEvent]:
        """Send a fatal error and go CLOSING (a wrong guess: when its turn comes)."""
        out = Outgoing(encode_head(cmd, _REPLY_ERROR, seq, exc.to_body(), 0))
        auth_ = is_auth or guess
        ev = Refused(exc, auth=auth_, guess=guess,
                     reason=reason or ("protocol" if auth_ else ""))
        if guess and self.verdicts is not None:
            at, ev.failures = self.verdicts.failed(self.now)
            ev.answer_at = at
            self._held, self._held_at = [out], at
        else:
            self.out.append(out)
        self._go(Input.REFUSED)
        return [ev]

    # -- HELLO and AUTH ----------------------------------------------------------------

    def _hello(self, frame: Frame) -> list[HandshakeEvent]:
        s = self.settings
        try:
            if int(frame.flags) & _NOT_REQUEST:
                raise BadRequest("a request must not carry REPLY, ERROR or EVENT flags")
            body = frame.body
            major = uint_field(body, "major")
            self.client_minor = uint_field(body, "minor")
            self.client_name = str_field(body, "client", "")
            if major != PROTO_MAJOR:
                raise VersionMismatch(f"client speaks major {major}, this server {PROTO_MAJOR}")
            reply: dict[str, Any] = {
                "major": PROTO_MAJOR,
                "minor": s.minor,
                "patch": PROTO_PATCH,
                "server": s.name,
                "features": list(s.features),
                "max_body": s.max_body,
                "max_payload": s.max_payload,
            }
            if s.max_message is not None:
                reply["max_message"] = s.max_message
            reply.update(s.limits)
            if not s.secret:
                self._send_reply(frame, reply)
                return self._ready(Input.HELLO_ACCEPTED, None)
            reply["auth"] = s.methods
            keys = self._keys = Keyring(s.secret, s.previous_secret)
            method = body.get("auth")
            if method == auth.HMAC_SHA256:
                nonce = body.get("nonce")
                if not isinstance(nonce, bytes) or len(nonce) != auth.NONCE_SIZE:
                    raise Unauthorized(
                        f"hmac-sha256 needs a nonce of {auth.NONCE_SIZE} bytes (bin)"
                    )
                self._nonce = nonce
                self._challenge = self._random(auth.NONCE_SIZE)
                reply["challenge"] = self._challenge
                reply["proof"] = auth.server_proof(keys.current, nonce, self._challenge)
                if keys.previous:
                    reply["previous_proof"] = auth.server_proof(keys.previous, nonce,
                                                                self._challenge)
                self.method = auth.HMAC_SHA256
                self._send_reply(frame, reply)
                self._go(Input.CHALLENGED)
                return []
            if method is not None and method != auth.TOKEN:
                raise Unauthorized(
                    f"unknown auth method {method!r}; this listener offers {', '.join(s.methods)}"
                )
            if "token" in body or method == auth.TOKEN:
                if not s.token_allowed:
                    raise Unauthorized(
                        "the token method is not offered on this listener (the token would "
                        "cross the wire in clear): use hmac-sha256"
                    )
                token = body.get("token")
                if not isinstance(token, str) or keys.match(token.encode(), bytes) is None:
                    return self.refuse(
                        Unauthorized("the client's token is wrong: it is not this daemon's "
                                     "server.token" if token else "token missing"),
                        frame.cmd, frame.seq, is_auth=True,
                        guess=isinstance(token, str) and bool(token),
                        reason="wrong_secret" if token else "no_secret",
                    )
                self.method = auth.TOKEN
                return self._token_accepted(frame, reply)
            return self.refuse(
                Unauthorized(
                    "authentication required: this daemon has a token (server.token_file) "
                    f"and the client gave none; this listener offers {', '.join(s.methods)}"
                ),
                frame.cmd, frame.seq, is_auth=True, reason="no_secret",
            )
        except TransferdError as exc:
            return self.refuse(exc, frame.cmd, frame.seq, is_auth=isinstance(exc, Unauthorized))

    def _token_accepted(self, frame: Frame, reply: dict[str, Any]) -> list[HandshakeEvent]:
        """A good token.  Its verdict is a guesser's only oracle (an hmac-sha256 proof
        already lets anyone test guesses offline), so with ``verdicts`` it is answered
        after its source's failures that still wait (TIMEOUT past the deadline)."""
        at = self.verdicts.success_at(self.now) if self.verdicts is not None else self.now
        if at is not None and at <= self.now:
            self._send_reply(frame, reply)
            return self._ready(Input.HELLO_ACCEPTED, auth.TOKEN)
        self._held = [Outgoing(encode_head(frame.cmd, _REPLY, frame.seq, reply, 0))]
        self._held_at = at
        self._held_ready = Ready(self.client_name, self.client_minor, auth.TOKEN)
        self._go(Input.HELD)
        return []

    def _auth(self, frame: Frame) -> list[HandshakeEvent]:
        mac = frame.body.get("mac")
        if not isinstance(mac, bytes) or len(mac) != auth.MAC_SIZE:
            return self.refuse(
                Unauthorized(f"AUTH needs a mac of {auth.MAC_SIZE} bytes (bin)"),
                frame.cmd, frame.seq, is_auth=True,
            )
        if self._keys.match(mac, lambda k: auth.client_mac(k, self._challenge,
                                                           self._nonce)) is None:
            return self.refuse(
                Unauthorized("wrong mac: the client's token is not this daemon's server.token"),
                frame.cmd, frame.seq, guess=True, reason="wrong_secret",
            )
        self._send_reply(frame, None)
        return self._ready(Input.AUTH_ACCEPTED, auth.HMAC_SHA256)

    def _send_reply(self, frame: Frame, body: dict[str, Any] | None) -> None:
        self.out.append(Outgoing(encode_head(frame.cmd, _REPLY, frame.seq, body, 0)))

    def _ready(self, inp: Input, method: str | None) -> list[HandshakeEvent]:
        self._go(inp)
        self._promote()
        return [Ready(self.client_name, self.client_minor, method)]

    def _promote(self) -> None:
        # The other side proved itself: its frames get the server's real limits.
        d = self.decoder
        d.gate = None
        d.max_body = self.settings.max_body
        d.max_payload = self.settings.max_payload
        # Not READ_CHUNK for good: large while bytes pour in, small again when quiet, so
        # that idle connections cost the daemon 8 KiB each, not 256 KiB or a body's size.
        d.elastic(HANDSHAKE_BUFFER)

    # -- the data phase: answers and events ---------------------------------------------

    def answer(self, frame: Frame, body: dict[str, Any] | None = None,
               payload: Sequence[Any] = (), hold: Sequence[Any] = (),
               fds: Sequence[int] = (), payload_len: int = -1) -> Outgoing | None:
        """The request ran: its reply to write (REPLY, with ``payload`` views sent from
        where they lie, ``hold`` going with it), or None when nothing goes out (the caller
        releases ``hold``): a one-way command, or a connection that began to close."""
        phase = self.phase
        if phase is _RUNNING:
            self.phase = _TO_IDLE  # SERVER_TRANSITIONS[RUNNING][ANSWERED]
        elif phase is not _IDLE:
            if phase is _CLOSING_P:
                self._go(Input.ANSWERED)
            return None
        if frame.flags & _NO_REPLY:
            return None
        if payload_len < 0:
            payload_len = sum(map(len, payload)) if payload else 0
        return _mk(Outgoing, (encode_head(frame.cmd, _REPLY, frame.seq, body, payload_len),
                              payload, payload_len, hold, fds))

    def answered(self, frame: Frame) -> None:
        """The request ran and its reply was written by the caller itself (a reply streamed
        from device memory, whose header came from :meth:`streamed_head`)."""
        if self.phase is _RUNNING:
            self.phase = _TO_IDLE
        elif self.phase is _CLOSING_P:
            self._go(Input.ANSWERED)

    def streamed_head(self, frame: Frame, payload_len: int) -> bytes:
        """The header of a reply whose payload the caller writes itself, piece by piece."""
        return encode_head(frame.cmd, _REPLY, frame.seq, None, payload_len)

    def fail(self, frame: Frame, exc: TransferdError) -> Outgoing | None:
        """The request failed: the frame to write, REPLY|ERROR, or EVENT|ERROR for a
        one-way command (``failure_frame``); a fatal error goes CLOSING.  None once the
        connection began to close."""
        phase = self.phase
        if phase is _RUNNING:
            self.phase = _TO_IDLE
        elif phase is not _IDLE:
            if phase is _CLOSING_P:
                self._go(Input.ANSWERED)
            return None
        flags, close = failure_frame(int(frame.flags), exc)
        if close:
            self._go(Input.REFUSED)
        return _mk(Outgoing, (encode_head(frame.cmd, flags, frame.seq, exc.to_body(), 0),
                              (), 0, (), ()))

    def request_failed(self, frame: Frame, exc: TransferdError) -> bool:
        """:meth:`fail`, its frame queued (for :meth:`data_to_send`); True when the
        connection closes (the first version of this API; tests use it)."""
        out = self.fail(frame, exc)
        if out is not None:
            self.out.append(out)
        return self.phase is _CLOSING_P or self.phase is _CLOSED_P

    def event(self, cmd: int, seq: int, body: dict[str, Any] | None = None, *,
              error: bool = False, payload: Sequence[Any] = (), hold: Sequence[Any] = (),
              fds: Sequence[int] = ()) -> Outgoing | None:
        """An EVENT frame to write, sent unasked (EVENT|ERROR with ``error``); only once
        READY and until the connection closes (None then)."""
        if self.state is not _READY_S:
            return None
        plen = sum(map(len, payload)) if payload else 0
        return _mk(Outgoing, (encode_head(cmd, _EVENT | _ERROR if error else _EVENT, seq,
                                          body, plen), payload, plen, hold, fds))


# The HELLO reply's limits (uints where present).
_HELLO_LIMITS = ("max_body", "max_payload", "max_tensors", "max_reply", "max_message")


# -- client -----------------------------------------------------------------------------------


class Pending(Protocol):
    """What the client registers with a request and gets back in its :class:`Answer`:
    the request's cmd and where its reply's payload goes (``sink``: memory, a callable
    that picks it once the reply is known good, or None)."""

    cmd: int
    sink: Any


_GETS = (int(Command.GET_TENSOR), int(Command.GET_TENSORS))
_EVENT_OR_ERROR = int(Flag.EVENT | Flag.ERROR)
_DECODER_BROKEN = _DecoderPhase.BROKEN
_D_HEADER = _DecoderPhase.HEADER


class ClientConnection(_Machine):
    """The client's side of one connection (see the module docstring).

    ``secret`` (bytes) authenticates with hmac-sha256 whenever the server asks
    for authentication; ``method="token"`` sends it as a token instead (only
    where the server offers that, and never where the transport is not
    ``private``: over plain tcp:// the token would cross the wire in clear).

    A client that holds a secret accepts only a server that proves it knows it:
    a HELLO reply that omits ``auth``, or lists it without a challenge and proof
    (hmac-sha256), is refused with UNAUTHORIZED naming ``address``, before any
    request (or tensor byte) goes to it.  With the token method nothing proves
    the server but the transport itself (the Unix socket's permissions, the TLS
    certificate); the reply must still list ``token``.

    ``max_collect`` bounds a payload nobody set memory up for (an EVENT's, a reply
    to anything but a GET): it is collected into a bytearray of the announced size,
    so a size over it is BAD_FRAME, not an allocation a lying server chose.
    """

    role = "client"
    table = CLIENT_TRANSITIONS

    def __init__(
        self,
        *,
        name: str = "transferd-client",
        max_minor: int = 2,
        secret: bytes | None = None,
        method: str = auth.HMAC_SHA256,
        random: Callable[[int], bytes] = os.urandom,
        address: str = "",
        private: bool = True,
        max_collect: int = 1 << 20,
    ) -> None:
        super().__init__()
        self._seq = 0
        self.prepare(name=name, max_minor=max_minor, secret=secret, method=method,
                     address=address, private=private)
        self._random = random
        self._nonce = b""
        self.server_hello: dict[str, Any] = {}
        self.max_collect = max_collect
        self.decoder = FrameDecoder(max_body=HELLO_MAX_BODY, payload_sink=self._sink)
        # The server's limits (from its HELLO reply): no frame over them is sent.
        self.max_body = 1 << 62
        self.max_payload = 1 << 62
        # seq -> what the caller registered (its cmd and sink), until the reply comes.
        self.pending: dict[int, Any] = {}
        self.lost: TransferdError | None = None

    # -- the handshake ---------------------------------------------------------------

    def prepare(self, *, name: str = "transferd-client", max_minor: int = 2,
                secret: bytes | None = None, method: str = auth.HMAC_SHA256,
                address: str = "", private: bool = True) -> None:
        """Who this client is and how it authenticates; before :meth:`start` only (an I/O
        layer that made the connection before it knew them)."""
        if self._seq or self.out:
            raise IllegalTransition("client connection: prepare() after start()")
        if method not in auth.METHODS:
            raise BadRequest(f"unknown auth method {method!r} (use one of {auth.METHODS})")
        # Where the server is (named in refusals), and whether its transport keeps the
        # bytes private (tls, unix, seqpacket): the token method only where it does.
        self.address = address
        if secret and method == auth.TOKEN and not private:
            raise BadRequest(
                f"{address or 'this transport'}: the token method would send the secret in "
                "clear; use hmac-sha256 (the default), or tls:// or a Unix socket")
        self.name = name
        self.max_minor = max_minor
        self.secret = secret or b""
        self.method = method

    def hello_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"major": PROTO_MAJOR, "minor": self.max_minor, "client": self.name}
        if self.secret:
            if self.method == auth.TOKEN:
                body["token"] = self.secret.decode()
            else:
                self._nonce = self._random(auth.NONCE_SIZE)
                body["auth"] = auth.HMAC_SHA256
                body["nonce"] = self._nonce
        return body

    def hello_reply(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The server's HELLO reply: the AUTH body to send next, or None when READY.

        Raises Unauthorized (and goes CLOSING) when the server's proof is
        wrong or missing: that server does not know the secret.
        """
        if self.phase is not _HELLO_P:
            self._go(Input.HELLO_ACCEPTED)  # raises IllegalTransition
        self.server_hello = body
        major = body.get("major")
        if type(major) is not int or major != PROTO_MAJOR:  # (True == 1: never a bool)
            self._go(Input.REFUSED)
            raise VersionMismatch(f"server speaks major {repr(major)[:40]}, this client "
                                  f"{PROTO_MAJOR}")
        try:
            # What the client reads off the reply: a lying server is refused here,
            # not met by a KeyError or ValueError in the caller.
            uint_field(body, "minor")
            uint_field(body, "patch")
            for name in _HELLO_LIMITS:
                if name in body:
                    uint_field(body, name)
            features = body.get("features", [])
            if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
                raise BadRequest("field 'features' must be a list of names")
        except BadRequest as exc:
            self._go(Input.REFUSED)
            raise BadFrame(f"the server's HELLO reply: {exc.message}") from None
        challenge = body.get("challenge")
        offered = body.get("auth")
        if not self.secret:
            if offered:
                self._go(Input.REFUSED)
                raise Unauthorized(f"{self._where}the server requires authentication "
                                   f"({offered})")
            self._go(Input.HELLO_ACCEPTED)
            self._limits()
            return None
        # This client holds a secret: only a server that proves it knows it is used.
        if not isinstance(offered, list) or not offered:
            self._go(Input.REFUSED)
            raise Unauthorized(
                f"{self._where}the server does not ask for authentication (its HELLO reply "
                "has no 'auth'), but this client holds a secret: a server that knows it "
                "lists auth and proves it, so this one is not trusted with any request")
        if self.method == auth.TOKEN:
            if auth.TOKEN not in offered:
                self._go(Input.REFUSED)
                raise Unauthorized(f"{self._where}the server accepted a token but lists "
                                   f"only {offered}: not trusted")
            self._go(Input.HELLO_ACCEPTED)
            self._limits()
            return None
        proof = body.get("proof")
        if challenge is None or proof is None:
            self._go(Input.REFUSED)
            raise Unauthorized(
                f"{self._where}the server lists auth {offered} but sends no challenge and "
                "proof: it does not prove it knows the secret, so it is not trusted")
        # During a rotation the server proves the secret in use before as well.
        proofs = [p for p in (proof, body.get("previous_proof")) if isinstance(p, bytes)]
        if (
            not self._nonce
            or not isinstance(challenge, bytes)
            or len(challenge) != auth.NONCE_SIZE
            or not proofs
            or not any([auth.same(p, auth.server_proof(self.secret, self._nonce, challenge))
                        for p in proofs])
        ):
            self._go(Input.REFUSED)
            # Nearly always this client's token, not the server: say so first.
            raise Unauthorized(
                f"{self._where}the token is wrong: the server's proof does not match this "
                "client's token (it differs from the daemon's server.token, or this is not "
                "the daemon meant)")
        self._go(Input.CHALLENGED)
        return {"mac": auth.client_mac(self.secret, challenge, self._nonce)}

    @property
    def _where(self) -> str:
        return f"{self.address}: " if self.address else ""

    def auth_reply(self) -> None:
        """AUTH was answered without an error."""
        self._go(Input.AUTH_ACCEPTED)
        self._limits()

    def _limits(self) -> None:
        b = self.server_hello
        self.max_body = int(b.get("max_body", DEFAULT_MAX_BODY))
        self.max_payload = int(b.get("max_payload", DEFAULT_MAX_PAYLOAD))
        self.decoder.max_body = max(DEFAULT_MAX_BODY, self.max_body)

    def refused(self, exc: TransferdError) -> None:
        if self.phase is not _CLOSED_P:
            self._go(Input.REFUSED)

    def start(self) -> None:
        """Queue HELLO (its reply, and AUTH where due, are handled as frames arrive)."""
        self._seq += 1
        self.out.append(Outgoing(encode_head(_HELLO, 0, self._seq, self.hello_body(), 0)))

    # -- the data phase ------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        """The seq of the request made last (what its reply or event will carry)."""
        return self._seq

    def request(self, cmd: int, body: dict[str, Any] | bytes | None = None,
                payload: Sequence[Any] = (), *, flags: int = 0, fds: Sequence[int] = (),
                token: Any = None, payload_len: int = -1) -> Outgoing:
        """A request: the frame to write (its seq is :attr:`last_seq`).  Unless NO_REPLY,
        ``token`` (with ``cmd`` and ``sink``: :class:`Pending`) is registered under the seq
        and comes back in its Answer.

        Nothing over the server's announced limits is sent (OverLimit, the connection
        untouched); nothing at all once the connection closes (ConnectionLost).
        """
        phase = self.phase
        if phase is _CLOSING_P or phase is _CLOSED_P:
            raise ConnectionLost(self.lost.message if self.lost else "connection is closed")
        seq = (self._seq + 1) & 0xFFFFFFFF or 1
        if payload_len < 0:
            payload_len = sum(map(len, payload)) if payload else 0
        head = encode_head(cmd, flags, seq, body, payload_len)
        if len(head) - 24 > self.max_body or payload_len > self.max_payload:
            # Refused here, not by the server (which would close the connection).
            raise OverLimit(
                f"a {command_name(cmd)} of {len(head) - 24} bytes of body and {payload_len} "
                f"of payload is over the server's max_body {self.max_body} / max_payload "
                f"{self.max_payload} (announced in HELLO): split it")
        self._seq = seq
        if token is not None and not flags & _NO_REPLY:
            self.pending[seq] = token
        return _mk(Outgoing, (head, payload, payload_len, (), fds))

    def forget(self, seq: int) -> Any:
        """Stop waiting for ``seq``'s reply (a timeout): its token, or None."""
        return self.pending.pop(seq, None)

    def _sink(self, frame: Frame) -> Sink:
        if (int(frame.flags) & _REPLY_ERROR) == _REPLY:  # a plain reply
            p = self.pending.get(frame.seq)
            if p is not None:
                sink = p.sink
                if sink is not None:
                    # A callable sink picks the memory now that the reply is known good.
                    return sink(frame) if callable(sink) else sink
                if p.cmd in _GETS:
                    return None  # collected: the size it asked for
        # A payload nobody set memory up for: collected only up to max_collect.
        if frame.payload_len > self.max_collect:
            raise BadFrame(f"a payload of {frame.payload_len} bytes on a "
                           f"{command_name(frame.cmd)} frame nothing asked for (at most "
                           f"{self.max_collect})", seq=frame.seq)
        return None

    def next_event(self) -> Answer | Notice | Refused | Ready | None:
        """The next frame that arrived, as an event (None: nothing complete).  A broken
        stream is a Refused (BAD_FRAME, TOO_LARGE) and the connection goes CLOSING."""
        d = self.decoder
        while True:
            phase = self.phase
            if d._start == d._end and d.phase is _D_HEADER:
                return None  # nothing buffered (checked without a call)
            if phase is _CLOSED_P or d.phase is _DECODER_BROKEN:
                return None
            try:
                f = d.next_frame()
            except ProtocolError as exc:
                if self.phase is not _CLOSING_P:
                    self._go(Input.REFUSED)
                return Refused(exc)
            if f is None:
                return None
            flags = f.flags
            if phase is _IDLE and not flags & _EVENT_OR_ERROR:
                # The usual frame: a plain reply.  (_data_event, inlined.)
                p = self.pending.pop(f.seq, None)
                if p is not None:
                    return _mk(Answer, (p, f, None))
                continue  # a reply to a seq given up on
            ev: Answer | Notice | Refused | Ready | None
            if phase is _IDLE or phase is _CLOSING_P or flags & _EVENT:
                ev = self._data_event(f)
            else:
                try:
                    events = self.receive_frame(f)
                except IllegalTransition:
                    # Not an answer to HELLO or AUTH: a server that breaks the handshake.
                    self._go(Input.REFUSED)
                    return Refused(BadFrame(
                        f"{self._where}a 0x{f.cmd:02x} frame (flags 0x{f.flags:02x}) during "
                        "the handshake, where only the HELLO and AUTH replies may come",
                        seq=f.seq))
                ev = events[0] if events else None
            if ev is not None:
                return ev

    def _data_event(self, f: Frame) -> Answer | Notice | Refused | None:
        flags = f.flags
        if flags & _EVENT:  # unasked; a one-way command's failure is never fatal
            return _mk(Notice, (f, error_from_body(f.body, seq=f.seq, fatal=False)
                                if flags & _ERROR else None))
        p = self.pending.pop(f.seq, None)
        err = None
        if flags & _ERROR:
            # No frame over the limits is sent, so a TOO_LARGE is a per-request cap.
            err = error_from_body(f.body, seq=f.seq, fatal=False)
            if err.fatal and self.phase is _IDLE:
                self._go(Input.REFUSED)
        if p is None:
            # A reply to a seq given up on (or a fatal error before any request).
            return Refused(err) if err is not None else None
        return _mk(Answer, (p, f, err))

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes in, without decoding them (a copying convenience; :meth:`next_event` then
        hands out what they hold).  An I/O layer uses the decoder's buffers instead."""
        src = memoryview(data).cast("B")
        d = self.decoder
        while len(src):
            dst = d.get_buffer(len(src))
            n = min(len(dst), len(src))
            if n == 0:
                return  # the decoder wants a frame taken first
            dst[:n] = src[:n]
            src = src[n:]
            d.buffer_updated(n)

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """The handshake on bytes (a copying convenience): its events.  Once READY a frame
        is an error reply (Refused) or, for this method, an IllegalTransition: the data
        phase's frames are :meth:`next_event`'s."""
        events: list[Event] = []
        for f in self.decoder.feed(data):
            events += self.receive_frame(f)
        return events

    def receive_frame(self, frame: Frame) -> list[HandshakeEvent]:
        """A frame during the handshake: the HELLO reply (then AUTH, queued), AUTH's."""
        if self.phase is _CLOSING_P or self.phase is _CLOSED_P:
            return []
        if int(frame.flags) & _REPLY_ERROR == _REPLY_ERROR:
            exc = error_from_body(frame.body, seq=frame.seq)
            self.refused(exc)
            return [Refused(exc, auth=isinstance(exc, Unauthorized))]
        try:
            if frame.cmd == _HELLO and self.phase is _HELLO_P:
                mac = self.hello_reply(frame.body)
                if mac is None:
                    return [self._ready_event()]
                self._seq += 1
                self.out.append(Outgoing(encode_head(_AUTH, 0, self._seq, mac, 0)))
                return []
            if frame.cmd == _AUTH and self.phase is _AUTH_P:
                self.auth_reply()
                return [self._ready_event()]
        except TransferdError as exc:
            return [Refused(exc, auth=isinstance(exc, Unauthorized))]
        raise IllegalTransition(
            f"client connection: a 0x{frame.cmd:02x} reply in phase {self.phase.name.lower()}"
        )

    def _ready_event(self) -> Ready:
        return Ready("", int(self.server_hello.get("minor", 0)),
                     self.method if self.secret and self.server_hello.get("auth") else None,
                     self.server_hello)

    def lose(self, exc: TransferdError) -> list[Any]:
        """The transport is gone: CLOSED; the tokens of every request still waiting."""
        if self.lost is None:
            self.lost = exc
        if self.phase is not _CLOSED_P:
            self._go(Input.LOST)
        pending, self.pending = self.pending, {}
        return list(pending.values())

    def detach(self) -> None:
        """The transport is gone and no byte comes in again: let go of the decoder's
        sink, a method of this connection (the decoder is held by it: a reference cycle
        only the cyclic collector frees, as :meth:`ServerConnection.detach`'s)."""
        self.decoder._sink_factory = None
