"""Sans-IO connections: the server side and the client side of HELLO and AUTH.

Each is a state machine over :class:`ConnState` with an explicit transition
table (h11's ``_state.py`` is the model): ``HELLO -> AUTH -> READY ->
CLOSING -> CLOSED``.  Bytes (or whole messages) go in with
``receive_data``, events come out, and the frames to write come out of
``data_to_send()``.  No sockets, no asyncio, no clock of its own: the time is
passed in (``now``), so a test runs a handshake timeout by advancing a number.
An input the table does not allow in the current state is a typed error,
:class:`IllegalTransition`.

Once READY the server connection hands request frames out as :class:`Request`
events; the asyncio session runs them on its own fast path (it pulls frames
from :attr:`ServerConnection.decoder` itself and only consults ``state``), so
the handshake costs the per-frame path nothing.

Before READY the server enforces PROTOCOL.md's pre-auth limits from the header
alone (:meth:`ServerConnection.check_header`, installed as the decoder's gate):
HELLO first (else NO_HELLO), then AUTH where due (else UNAUTHORIZED), each with
at most 4096 bytes of body and no payload (else TOO_LARGE); the decoder's
buffer is a few KiB until then, and never grows for a body the other side only
announced.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import auth
from .constants import PROTO_MAJOR, PROTO_PATCH, Command, Flag
from .errors import (
    BadFrame,
    BadRequest,
    Internal,
    NoHello,
    ProtocolError,
    Timeout,
    TooLarge,
    TransferdError,
    Unauthorized,
    VersionMismatch,
    error_from_body,
)
from .frames import Frame, FrameDecoder, RawHeader, encode_frame
from .messages import str_field, uint_field

# The decoder's buffer before READY: a header and the largest pre-auth body.
HANDSHAKE_BUFFER = 8192


class ConnState(enum.Enum):
    HELLO = "hello"  # waiting for HELLO (server) or its reply (client)
    AUTH = "auth"  # the challenge is out: waiting for AUTH (server) or its reply (client)
    READY = "ready"
    CLOSING = "closing"  # a fatal error was sent (or received); the transport closes
    CLOSED = "closed"


class Input(enum.Enum):
    HELLO_ACCEPTED = "hello_accepted"  # no authentication due, or the token was good
    CHALLENGED = "challenged"  # hmac-sha256: the challenge (server) / AUTH (client) is out
    AUTH_ACCEPTED = "auth_accepted"
    REFUSED = "refused"  # a fatal error went out (server) or came in (client)
    TIMED_OUT = "timed_out"
    LOST = "lost"  # the transport is gone


_S = ConnState
_I = Input

# state -> {input: next state}; anything else is IllegalTransition.
TRANSITIONS: dict[ConnState, dict[Input, ConnState]] = {
    _S.HELLO: {
        _I.HELLO_ACCEPTED: _S.READY,
        _I.CHALLENGED: _S.AUTH,
        _I.REFUSED: _S.CLOSING,
        _I.TIMED_OUT: _S.CLOSING,
        _I.LOST: _S.CLOSED,
    },
    _S.AUTH: {
        _I.AUTH_ACCEPTED: _S.READY,
        _I.REFUSED: _S.CLOSING,
        _I.TIMED_OUT: _S.CLOSING,
        _I.LOST: _S.CLOSED,
    },
    _S.READY: {_I.REFUSED: _S.CLOSING, _I.LOST: _S.CLOSED},
    _S.CLOSING: {_I.REFUSED: _S.CLOSING, _I.TIMED_OUT: _S.CLOSING, _I.LOST: _S.CLOSED},
    _S.CLOSED: {_I.LOST: _S.CLOSED},
}


class IllegalTransition(Internal):
    """An input the transition table does not allow in the current state (a bug)."""


# -- events -------------------------------------------------------------------------------


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
    token, a mac): the server logs it with the source address and answers it
    after the source's back-off.  A HELLO without credentials, or with a malformed
    mac, tells a guesser nothing about the secret: answered at once.
    """

    error: TransferdError
    auth: bool = False
    guess: bool = False


@dataclass
class Request:
    """Server side, READY: a request frame for the command handlers."""

    frame: Frame


Event = Ready | Refused | Request


class _Machine:
    role = "?"

    def __init__(self) -> None:
        self.state = ConnState.HELLO
        self._out: list[bytes] = []

    def _go(self, inp: Input) -> None:
        nxt = TRANSITIONS[self.state].get(inp)
        if nxt is None:
            raise IllegalTransition(
                f"{self.role} connection: {inp.value} in state {self.state.value}"
            )
        self.state = nxt

    def data_to_send(self) -> bytes:
        """The frames this side has to write, in order (empty when none)."""
        out, self._out = self._out, []
        return b"".join(out)

    def frames_to_send(self) -> list[bytes]:
        """Like data_to_send, one bytes per frame (a message transport sends each alone)."""
        out, self._out = self._out, []
        return out

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
    # The shared secret (b"": no authentication required).
    secret: bytes = b""
    # Whether this listener offers the token method (the token crosses the wire).
    token_allowed: bool = False
    # Message transports announce their continuation size in HELLO.
    max_message: int | None = None
    handshake_timeout: float = 5.0
    # Per-request caps announced in HELLO besides max_body / max_payload
    # (max_tensors, max_reply): the session enforces them.
    limits: dict[str, int] = field(default_factory=dict)

    @property
    def methods(self) -> list[str]:
        if not self.secret:
            return []
        return [auth.HMAC_SHA256, auth.TOKEN] if self.token_allowed else [auth.HMAC_SHA256]


_HELLO = int(Command.HELLO)
_AUTH = int(Command.AUTH)
_REPLY = int(Flag.REPLY)
_REPLY_ERROR = int(Flag.REPLY | Flag.ERROR)
_NOT_REQUEST = int(Flag.REPLY | Flag.ERROR | Flag.EVENT)
_BATCHES = (int(Command.GET_TENSORS), int(Command.SET_TENSORS))


class ServerConnection(_Machine):
    """The server's side of one connection's handshake (see the module docstring)."""

    role = "server"

    def __init__(
        self,
        settings: ServerSettings,
        now: float,
        *,
        random: Callable[[int], bytes] = os.urandom,
        payload_sink: Any = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.deadline = now + settings.handshake_timeout
        self._random = random
        self.decoder = FrameDecoder(
            max_body=auth.PRE_AUTH_MAX_BODY,
            max_payload=0,
            payload_sink=payload_sink,
            buffer_size=HANDSHAKE_BUFFER,
        )
        self.decoder.gate = self.check_header
        if "max_tensors" in settings.limits:  # a longer batch is refused, not decoded
            self.decoder.array_caps = dict.fromkeys(_BATCHES, settings.limits["max_tensors"])
        self.client_name = ""
        self.client_minor = 0
        self.method: str | None = None
        self._nonce = b""
        self._challenge = b""

    # -- input ------------------------------------------------------------------------

    def check_header(self, h: RawHeader) -> None:
        """The pre-auth gate: judge a frame from its header alone (raises)."""
        if h.magic != b"TD" or h.reserved or h.flags & ~0x0F:
            return  # the decoder's own checks name the fault (BAD_FRAME)
        state = self.state
        if state is ConnState.HELLO:
            if h.cmd != _HELLO:
                raise NoHello("the first frame of a connection must be HELLO", seq=h.seq)
            what = "HELLO"
        elif state is ConnState.AUTH:
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

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """Bytes in (a copying convenience; the asyncio session feeds the decoder itself)."""
        events: list[Event] = []
        src = memoryview(data).cast("B")
        d = self.decoder
        while True:
            # Frame by frame: the gate judges each header in the state that
            # the frames before it left.
            while self.state is not ConnState.CLOSING and self.state is not ConnState.CLOSED:
                try:
                    f = d.next_frame()
                except ProtocolError as exc:
                    return events + self.refuse(exc, d.current_cmd, exc.seq or 0)
                if f is None:
                    break
                events += self.receive_frame(f)
            if not len(src) or self.state is ConnState.CLOSING or self.state is ConnState.CLOSED:
                return events
            dst = d.get_buffer(len(src))
            n = min(len(dst), len(src))
            dst[:n] = src[:n]
            src = src[n:]
            d.buffer_updated(n)

    def receive_frame(self, frame: Frame) -> list[Event]:
        state = self.state
        if state is ConnState.READY:
            return [Request(frame)]
        if state is ConnState.HELLO:
            return self._hello(frame)
        if state is ConnState.AUTH:
            return self._auth(frame)
        return []  # CLOSING / CLOSED: nothing more is read

    def handle_timeout(self, now: float) -> list[Event]:
        """Call at (or after) :attr:`deadline`: closes a handshake that did not finish."""
        if self.state not in (ConnState.HELLO, ConnState.AUTH) or now < self.deadline:
            return []
        cmd = _HELLO if self.state is ConnState.HELLO else _AUTH
        exc = Timeout(
            f"{'HELLO' if cmd == _HELLO else 'AUTH'} did not arrive within "
            f"{self.settings.handshake_timeout:g} s"
        )
        self._out.append(encode_frame(cmd, _REPLY_ERROR, 0, exc.to_body()))
        self._go(Input.TIMED_OUT)
        return [Refused(exc)]

    def refuse(self, exc: TransferdError, cmd: int, seq: int, *, is_auth: bool = False,
               guess: bool = False) -> list[Event]:
        """Send a fatal error and go CLOSING."""
        self._out.append(encode_frame(cmd, _REPLY_ERROR, seq, exc.to_body()))
        self._go(Input.REFUSED)
        return [Refused(exc, auth=is_auth or guess, guess=guess)]

    # -- HELLO and AUTH ----------------------------------------------------------------

    def _hello(self, frame: Frame) -> list[Event]:
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
                reply["proof"] = auth.server_proof(s.secret, nonce, self._challenge)
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
                if not isinstance(token, str) or not auth.same(token.encode(), s.secret):
                    return self.refuse(
                        Unauthorized("a valid token is required" if token else "token missing"),
                        frame.cmd, frame.seq, is_auth=True,
                        guess=isinstance(token, str) and bool(token),
                    )
                self.method = auth.TOKEN
                self._send_reply(frame, reply)
                return self._ready(Input.HELLO_ACCEPTED, auth.TOKEN)
            return self.refuse(
                Unauthorized(
                    f"authentication required: this listener offers {', '.join(s.methods)}"
                ),
                frame.cmd, frame.seq, is_auth=True,
            )
        except TransferdError as exc:
            return self.refuse(exc, frame.cmd, frame.seq, is_auth=isinstance(exc, Unauthorized))

    def _auth(self, frame: Frame) -> list[Event]:
        mac = frame.body.get("mac")
        if not isinstance(mac, bytes) or len(mac) != auth.MAC_SIZE:
            return self.refuse(
                Unauthorized(f"AUTH needs a mac of {auth.MAC_SIZE} bytes (bin)"),
                frame.cmd, frame.seq, is_auth=True,
            )
        want = auth.client_mac(self.settings.secret, self._challenge, self._nonce)
        if not auth.same(mac, want):
            return self.refuse(Unauthorized("wrong mac"), frame.cmd, frame.seq, guess=True)
        self._send_reply(frame, None)
        return self._ready(Input.AUTH_ACCEPTED, auth.HMAC_SHA256)

    def request_failed(self, frame: Frame, exc: TransferdError) -> bool:
        """READY: queue the answer to a request that failed (``failure_frame``); True when
        the connection closes (a fatal error: the state goes to CLOSING)."""
        flags, close = failure_frame(int(frame.flags), exc)
        self._out.append(encode_frame(frame.cmd, flags, frame.seq, exc.to_body()))
        if close:
            self._go(Input.REFUSED)
        return close

    def _send_reply(self, frame: Frame, body: dict[str, Any] | None) -> None:
        self._out.append(encode_frame(frame.cmd, _REPLY, frame.seq, body))

    def _ready(self, inp: Input, method: str | None) -> list[Event]:
        self._go(inp)
        # The other side proved itself: its frames get the server's real limits.
        d = self.decoder
        d.gate = None
        d.max_body = self.settings.max_body
        d.max_payload = self.settings.max_payload
        d.grow_buffer()
        return [Ready(self.client_name, self.client_minor, method)]


# The HELLO reply's limits (uints where present).
_HELLO_LIMITS = ("max_body", "max_payload", "max_tensors", "max_reply", "max_message")


# -- client -----------------------------------------------------------------------------------


class ClientConnection(_Machine):
    """The client's side of the handshake.

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

    The asyncio client uses :meth:`hello_body`, :meth:`hello_reply` and
    :meth:`auth_reply` around its own requests; :meth:`start` and
    :meth:`receive_data` do the same on bytes.
    """

    role = "client"

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
    ) -> None:
        super().__init__()
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
        self._random = random
        self._nonce = b""
        self.server_hello: dict[str, Any] = {}
        self.decoder = FrameDecoder(max_body=64 * 1024, max_payload=0)
        self._seq = 0

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
        if self.state is not ConnState.HELLO:
            self._go(Input.HELLO_ACCEPTED)  # raises IllegalTransition
        self.server_hello = body
        major = body.get("major")
        if major != PROTO_MAJOR:
            self._go(Input.REFUSED)
            raise VersionMismatch(f"server speaks major {major}, this client {PROTO_MAJOR}")
        try:
            # What the client reads off the reply: a lying server is refused here,
            # not met by a KeyError or ValueError in the caller.
            uint_field(body, "minor")
            uint_field(body, "patch")
            for name in _HELLO_LIMITS:
                if name in body:
                    uint_field(body, name)
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
            return None
        proof = body.get("proof")
        if challenge is None or proof is None:
            self._go(Input.REFUSED)
            raise Unauthorized(
                f"{self._where}the server lists auth {offered} but sends no challenge and "
                "proof: it does not prove it knows the secret, so it is not trusted")
        if (
            not self._nonce
            or not isinstance(challenge, bytes)
            or len(challenge) != auth.NONCE_SIZE
            or not isinstance(proof, bytes)
            or not auth.same(proof, auth.server_proof(self.secret, self._nonce, challenge))
        ):
            self._go(Input.REFUSED)
            raise Unauthorized(f"{self._where}the server's proof is wrong: it does not know "
                               "the secret")
        self._go(Input.CHALLENGED)
        return {"mac": auth.client_mac(self.secret, challenge, self._nonce)}

    @property
    def _where(self) -> str:
        return f"{self.address}: " if self.address else ""

    def auth_reply(self) -> None:
        """AUTH was answered without an error."""
        self._go(Input.AUTH_ACCEPTED)

    def refused(self, exc: TransferdError) -> None:
        if self.state is not ConnState.CLOSED:
            self._go(Input.REFUSED)

    # -- on bytes (in-memory tests, other I/O layers) ----------------------------------

    def start(self) -> None:
        """Queue HELLO."""
        self._seq += 1
        self._out.append(encode_frame(_HELLO, 0, self._seq, self.hello_body()))

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event]:
        events: list[Event] = []
        for f in self.decoder.feed(data):
            events += self.receive_frame(f)
        return events

    def receive_frame(self, frame: Frame) -> list[Event]:
        if self.state is ConnState.CLOSING or self.state is ConnState.CLOSED:
            return []
        if int(frame.flags) & _REPLY_ERROR == _REPLY_ERROR:
            exc = error_from_body(frame.body, seq=frame.seq)
            self.refused(exc)
            return [Refused(exc, auth=isinstance(exc, Unauthorized))]
        try:
            if frame.cmd == _HELLO and self.state is ConnState.HELLO:
                mac = self.hello_reply(frame.body)
                if mac is None:
                    return [self._ready_event()]
                self._seq += 1
                self._out.append(encode_frame(_AUTH, 0, self._seq, mac))
                return []
            if frame.cmd == _AUTH and self.state is ConnState.AUTH:
                self.auth_reply()
                return [self._ready_event()]
        except TransferdError as exc:
            return [Refused(exc, auth=isinstance(exc, Unauthorized))]
        raise IllegalTransition(
            f"client connection: a 0x{frame.cmd:02x} reply in state {self.state.value}"
        )

    def _ready_event(self) -> Ready:
        return Ready("", int(self.server_hello.get("minor", 0)),
                     self.method if self.secret and self.server_hello.get("auth") else None,
                     self.server_hello)
