"""The peer handshake, sans-IO: two daemons prove who they are before any write.

One :class:`PeerHandshake` per link end.  Frames in (:meth:`receive`), frames
out (:meth:`data_to_send`), the clock passed in (``now``, :meth:`tick`); no
sockets and no asyncio, so both ends can be wired to each other in memory.
Every move is a row of :data:`TRANSITIONS`; anything else is a typed error
and the link is closed.

With a cluster secret (``engine.secret_file``) both ends prove it, over
fresh nonces, with separate labels per direction (as the client AUTH of
PROTOCOL.md does)::

    initiator                                   responder
    HELLO {v, node, group, rail, addrs, nonce, auth: "hmac-sha256"}  ->
         <-  HELLO reply {v, node, group, rail, addrs, challenge, proof}
             proof = HMAC(secret, "transferd-peer-responder-v1" + nonce + challenge + T)
    AUTH {mac}  ->   mac = HMAC(secret, "transferd-peer-initiator-v1" + challenge + nonce + T)
         <-  AUTH reply {}  (or UNAUTHORIZED, and the link is closed)

``T`` is the msgpack of both identities (node, group and every rail's
address), so neither end's claimed addresses can be changed in flight.  A
replayed HELLO or AUTH fails: the other end's nonce is new on every link.

During a rotation of the secret (``engine.previous_secret_file``) an end
holds a :class:`~.keyring.Keyring` of two: the responder adds
``previous_proof`` (the same HMAC under the secret in use before), the
initiator takes whichever proof one of its own secrets makes and proves that
secret in AUTH, and the responder accepts a mac under either.  So a daemon
that has the new secret links with one that still has only the old, both ways.

Without a secret nothing can be proven, but an initiator can still be held
to the addresses it claims: the responder sends a random token in a PROBE
frame, on a connection of its own, to the initiator's listener for this rail
(the :class:`Probe` event; the I/O layer sends it), and the initiator must
echo it in AUTH {token}.  A raw socket that does not listen at the address
it claims never learns the token, and a daemon asked to echo a nonce it did
not send stays silent.  And a daemon's node id is then its addresses': the
HELLO lists every group's rail addresses (``all``), and the id must be
:func:`node_of` them.  So nobody can claim another daemon's id: it would have
to list that daemon's addresses, and the PROBE to the one it claims for this
group goes to that daemon, which never sent the nonce.

An initiator also checks that the responder is who it dialled: the node and
group it expected, answering on the address it connected to.

What a responder reads beyond the data phase of version 2 it names in its HELLO
reply's ``features`` (a list of names; absent: none, as from a daemon before issue
20), and its initiator uses no more than those (:attr:`PeerHandshake.peer_features`):
``send-ext`` (:data:`SEND_EXT`), a SEND may carry an extension block (peer_wire
TX_EXT: the trace id).  A name unknown here is ignored.  The list is not part of the
proven transcript: whoever could strip it in flight only makes the initiator send
less (a SEND without its trace id), never something the responder cannot read.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from .constants import MAX_RAILS, Flag
from .errors import (
    BadFrame,
    BadRequest,
    NoHello,
    Timeout,
    TransferdError,
    Unauthorized,
    error_from_body,
)
from .frames import Frame, encode_frame
from .keyring import Keyring
from .peer import PeerCommand

# 2: the data phase after the handshake is peer_wire's fixed headers (1 spoke msgpack).
VERSION = 2
# Without a secret: the most groups a HELLO's ``all`` lists (engine.host_groups <= 8).
MAX_GROUPS = 16
NODE_LABEL = b"transferd-node-v1"
METHOD = "hmac-sha256"
NONCE_LEN = 32
MAC_LEN = 32
# Before the handshake is done a link takes bodies of at most this and no payload.
MAX_HANDSHAKE_BODY = 4096
MAX_ADDR_LEN = 256
DEFAULT_TIMEOUT = 5.0
RESPONDER_LABEL = b"transferd-peer-responder-v1"
INITIATOR_LABEL = b"transferd-peer-initiator-v1"

# The features a responder may name in its HELLO reply (see the module docstring).
SEND_EXT = "send-ext"
MAX_FEATURES = 32
MAX_FEATURE_LEN = 64

_REPLY = int(Flag.REPLY)
_ERROR = int(Flag.ERROR)


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """A daemon's domain group: its node id, its group and one opaque address per rail."""

    node: int
    group: int
    addrs: tuple[bytes, ...]

    @property
    def key(self) -> tuple[int, int]:
        return (self.node, self.group)


class Role(enum.Enum):
    INITIATOR = "initiator"
    RESPONDER = "responder"


class State(enum.Enum):
    START = "start"
    HELLO_SENT = "hello-sent"  # initiator: waiting for the HELLO reply
    AWAIT_PROBE = "await-probe"  # initiator, no secret: waiting for the token
    AUTH_SENT = "auth-sent"  # initiator: waiting for the AUTH reply
    AWAIT_HELLO = "await-hello"  # responder
    AWAIT_AUTH = "await-auth"  # responder
    READY = "ready"
    CLOSED = "closed"


class Input(enum.Enum):
    START = "start"
    HELLO = "hello"
    HELLO_REPLY = "hello-reply"
    # Without a secret, a HELLO reply that came before the PROBE's token.
    REPLY_BEFORE_TOKEN = "reply-before-token"
    PROBE = "probe"
    AUTH = "auth"
    AUTH_REPLY = "auth-reply"
    TIMEOUT = "timeout"
    ERROR = "error"


INI, RES = Role.INITIATOR, Role.RESPONDER
S = State
# (role, state, input) -> next state.  A PROBE may overtake the HELLO reply
# (it comes on another connection): the initiator keeps the token and uses
# it once the reply is in.
TRANSITIONS: dict[tuple[Role, State, Input], State] = {
    (INI, S.START, Input.START): S.HELLO_SENT,
    (INI, S.HELLO_SENT, Input.PROBE): S.HELLO_SENT,
    (INI, S.HELLO_SENT, Input.HELLO_REPLY): S.AUTH_SENT,  # with a secret, or a token kept
    (INI, S.HELLO_SENT, Input.REPLY_BEFORE_TOKEN): S.AWAIT_PROBE,
    (INI, S.AWAIT_PROBE, Input.PROBE): S.AUTH_SENT,
    (INI, S.AUTH_SENT, Input.AUTH_REPLY): S.READY,
    (RES, S.AWAIT_HELLO, Input.HELLO): S.AWAIT_AUTH,
    (RES, S.AWAIT_AUTH, Input.AUTH): S.READY,
}
for _role in Role:
    for _state in State:
        if _state not in (S.READY, S.CLOSED):
            TRANSITIONS[(_role, _state, Input.TIMEOUT)] = S.CLOSED
            TRANSITIONS[(_role, _state, Input.ERROR)] = S.CLOSED
    TRANSITIONS[(_role, S.READY, Input.ERROR)] = S.CLOSED


@dataclass(frozen=True, slots=True)
class Ready:
    """The handshake is done: ``peer`` is who the other end proved to be."""

    peer: PeerIdentity


@dataclass(frozen=True, slots=True)
class Probe:
    """Send ``data`` (a PROBE frame) on a new connection to ``addr``, then close it."""

    addr: bytes
    data: bytes


Event = Ready | Probe


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret, label + a + b + transcript, hashlib.sha256).digest()


def _bin(body: dict[str, Any], name: str, length: int) -> bytes:
    v = body.get(name)
    if type(v) is not bytes or len(v) != length:
        raise BadFrame(f"peer handshake: {name!r} must be {length} bytes")
    return v


def _identity(body: dict[str, Any], rails: int) -> tuple[PeerIdentity, int]:
    """The identity and rail a HELLO (or its reply) claims, every field checked."""
    if body.get("v") != VERSION:
        raise BadFrame(f"peer handshake version {body.get('v')!r}, this daemon speaks "
                       f"{VERSION}")
    node, group, rail = body.get("node"), body.get("group"), body.get("rail")
    for name, v, top in (("node", node, (1 << 64) - 1), ("group", group, 0xFFFF),
                         ("rail", rail, MAX_RAILS - 1)):
        if type(v) is not int or not 0 <= v <= top:
            raise BadFrame(f"peer handshake: {name!r} must be an integer in [0, {top}]")
    addrs = body.get("addrs")
    if (type(addrs) is not list or not 1 <= len(addrs) <= MAX_RAILS
            or not all(type(a) is bytes and 0 < len(a) <= MAX_ADDR_LEN for a in addrs)):
        raise BadFrame(f"peer handshake: 'addrs' must be 1 to {MAX_RAILS} addresses "
                       "(bytes)")
    assert isinstance(node, int) and isinstance(group, int) and isinstance(rail, int)
    if len(addrs) != rails:
        raise BadRequest(f"rail count mismatch: peer has {len(addrs)} rail(s), this daemon "
                         f"{rails}; every peer must have the same number of NICs")
    if rail >= len(addrs):
        raise BadFrame(f"peer handshake: 'rail' {rail} is not one of the {len(addrs)} "
                       "rail(s) it lists")
    if node == 0:
        raise BadFrame("peer handshake: node id 0 is not a daemon")
    return PeerIdentity(node, group, tuple(addrs)), rail


class PeerHandshake:
    """One end of a link's handshake (see the module docstring)."""

    def __init__(
        self,
        role: Role,
        me: PeerIdentity,
        rail: int,
        secret: bytes | Keyring | None,
        now: float,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        expect: tuple[int, int, bytes] | None = None,
        random: Callable[[int], bytes] = secrets.token_bytes,
        admit: Callable[[PeerIdentity], None] | None = None,
        everyone: tuple[tuple[bytes, ...], ...] | None = None,
        features: Sequence[str] = (),
    ) -> None:
        if role is Role.INITIATOR and expect is None:
            raise ValueError("an initiator knows whom it dials: expect=(node, group, addr)")
        self.role = role
        self.me = me
        self.rail = rail
        # Taken once: a reload swaps the group's keyring for the next links, not this one.
        self.keys = Keyring.of(secret)
        self.secret = self.keys.current or None
        self.deadline = now + timeout
        self.timeout = timeout
        self.expect = expect
        self._random = random
        # Without a secret, every group's addresses of this daemon (an initiator's
        # HELLO lists them: its node id is node_of them).
        self.everyone = everyone or (me.addrs,)
        # Called with the proven peer before the link is ready; raising a
        # TransferdError refuses it (the peer book's binding check).
        self._admit = admit or (lambda peer: None)
        self.state = State.START if role is Role.INITIATOR else State.AWAIT_HELLO
        self.peer: PeerIdentity | None = None
        self.nonce = b""  # the initiator's
        self._challenge = b""  # the responder's (a token without a secret)
        self._token: bytes | None = None  # the initiator's, from a PROBE
        self._transcript = b""
        self._out: list[bytes] = []
        self._events: list[Event] = []
        self.error: TransferdError | None = None
        # Why it failed, one of transferd.authlog.REASONS (logged and counted there).
        self.reason = ""
        # Initiator: who the daemon dialled said it is, when that was not who was
        # expected (the dial's back-off is then the expected identity's, not the address's).
        self.answered: tuple[int, int] | None = None
        # Responder: what its HELLO reply says it reads (SEND_EXT); initiator: what the
        # responder's said (empty: a daemon before issue 20; nothing beyond version 2).
        self.features = tuple(features)
        self.peer_features: frozenset[str] = frozenset()

    # -- the I/O side's calls -----------------------------------------------------

    def data_to_send(self) -> bytes:
        out, self._out = self._out, []
        return b"".join(out)

    def events(self) -> list[Event]:
        ev, self._events = self._events, []
        return ev

    @property
    def done(self) -> bool:
        return self.state is State.READY

    def start(self) -> None:
        """Initiator: queue HELLO."""
        self._move(Input.START)
        self.nonce = self._random(NONCE_LEN)
        body = self._hello_body()
        body["nonce"] = self.nonce
        if self.secret is not None:
            body["auth"] = METHOD
        else:
            body["all"] = [list(g) for g in self.everyone]
        self._out.append(encode_frame(PeerCommand.HELLO, 0, 0, body))

    def receive(self, frame: Frame, now: float) -> None:
        """Take one frame of the other end; raises a TransferdError (the link is over)."""
        try:
            self._check_clock(now)
            self._receive(frame)
        except TransferdError as exc:
            self._fail(exc, frame.cmd)
            raise

    def probe(self, token: bytes, now: float) -> None:
        """Initiator without a secret: the token a PROBE brought to our listener."""
        try:
            self._check_clock(now)
            if len(token) != NONCE_LEN:
                raise BadFrame(f"peer handshake: a probe token is {NONCE_LEN} bytes")
            if self.secret is not None or self._token is not None:
                raise BadFrame("peer handshake: a probe nobody expected")
            if self.state is State.HELLO_SENT:
                self._move(Input.PROBE)
                self._token = token
                return
            self._move(Input.PROBE)
            self._token = token
            self._send_auth()
        except TransferdError as exc:
            self._fail(exc, None)
            raise

    def tick(self, now: float) -> None:
        """Raises Timeout once the handshake ran past its deadline unfinished."""
        try:
            self._check_clock(now)
        except TransferdError as exc:
            self._fail(exc, None)
            raise

    # -- transitions -------------------------------------------------------------------

    def _move(self, what: Input) -> None:
        want = TRANSITIONS.get((self.role, self.state, what))
        if want is None:
            raise BadFrame(f"peer handshake ({self.role.value}): {what.value} is not "
                           f"allowed in state {self.state.value}")
        self.state = want

    def _check_clock(self, now: float) -> None:
        if self.state not in (State.READY, State.CLOSED) and now >= self.deadline:
            self._move(Input.TIMEOUT)
            raise Timeout(f"peer handshake not finished in {self.timeout:g} s")

    def _fail(self, exc: TransferdError, cmd: int | None) -> None:
        if self.state is State.CLOSED:
            self.error = self.error or exc
            return
        self.reason = self.reason or _reason(exc)
        if self.role is Role.RESPONDER and cmd is not None:
            # Tell the initiator why, so its operator reads the cause, not a reset.
            self._out.append(encode_frame(cmd, _REPLY | _ERROR, 0, exc.to_body()))
        self.state = State.CLOSED
        self.error = exc

    def _receive(self, frame: Frame) -> None:
        if frame.payload_len:
            raise BadFrame("peer handshake frames carry no payload")
        cmd, reply = frame.cmd, frame.is_reply
        if self.state in (State.READY, State.CLOSED):
            raise BadFrame(f"peer frame 0x{cmd:02x} after the handshake "
                           f"({self.state.value})")
        if self.role is Role.RESPONDER:
            if self.state is State.AWAIT_HELLO:
                if cmd != PeerCommand.HELLO or reply:
                    raise NoHello(f"peer frame 0x{cmd:02x} before HELLO")
                self._on_hello(frame.body)
            else:
                if cmd != PeerCommand.AUTH or reply:
                    raise self._deny("protocol", f"peer frame 0x{cmd:02x} where AUTH is due")
                self._on_auth(frame.body)
            return
        if frame.is_error and reply:
            err = _refused(frame.body)
            if isinstance(err, Unauthorized):
                # What a receiving daemon refuses: a secret one side lacks (at HELLO),
                # or, after our AUTH, the probe's echo.
                self.reason = ("no_secret" if self.state is State.HELLO_SENT
                               else "wrong_secret" if self.secret is not None else "identity")
            raise err
        if self.state is State.HELLO_SENT and cmd == PeerCommand.HELLO and reply:
            self._on_reply(frame.body)
        elif self.state is State.AUTH_SENT and cmd == PeerCommand.AUTH and reply:
            assert self.peer is not None
            self._admit_peer(self.peer)
            self._move(Input.AUTH_REPLY)
            self._events.append(Ready(self.peer))
        else:
            raise BadFrame(f"peer frame 0x{cmd:02x} (reply={reply}) is not allowed in "
                           f"state {self.state.value}")

    # -- responder ------------------------------------------------------------------------

    def _on_hello(self, body: dict[str, Any]) -> None:
        peer, rail = _identity(body, len(self.me.addrs))
        nonce = _bin(body, "nonce", NONCE_LEN)
        if rail != self.rail:
            raise BadRequest(f"peer dialled rail {rail} on this daemon's rail {self.rail}")
        offered = body.get("auth")
        # Sent to the dialling daemon too: the text names each side by its role.
        if self.secret is not None and offered != METHOD:
            raise self._deny("no_secret", "the receiving daemon requires the cluster secret "
                             "(engine.secret_file) and the dialling daemon has none: give "
                             "both the same secret")
        if self.secret is None and offered is not None:
            raise self._deny("no_secret", "the receiving daemon has no cluster secret "
                             "(engine.secret_file) and the dialling daemon has one: give "
                             "both the same secret")
        if self.secret is None:
            try:
                _check_node(peer, body.get("all"))
            except Unauthorized:
                self.reason = "identity"  # another daemon's node id
                raise
        self._move(Input.HELLO)
        self.peer = peer
        self.nonce = nonce
        self._challenge = self._random(NONCE_LEN)
        self._transcript = _transcript(peer, self.me, rail)
        reply = self._hello_body()
        if self.features:
            reply["features"] = list(self.features)
        if self.secret is not None:
            reply["challenge"] = self._challenge
            reply["proof"] = _mac(self.secret, RESPONDER_LABEL, nonce, self._challenge,
                                  self._transcript)
            if self.keys.previous:
                reply["previous_proof"] = _mac(self.keys.previous, RESPONDER_LABEL, nonce,
                                               self._challenge, self._transcript)
        else:
            probe = {"nonce": nonce, "token": self._challenge}
            self._events.append(Probe(peer.addrs[rail],
                                      encode_frame(PeerCommand.PROBE, 0, 0, probe)))
        self._out.append(encode_frame(PeerCommand.HELLO, _REPLY, 0, reply))

    def _on_auth(self, body: dict[str, Any]) -> None:
        if self.secret is not None:
            mac = _bin(body, "mac", MAC_LEN)
            if self.keys.match(mac, lambda k: _mac(k, INITIATOR_LABEL, self._challenge,
                                                   self.nonce, self._transcript)) is None:
                raise self._deny("wrong_secret", "the dialling daemon did not prove the "
                                 "cluster secret: its engine.secret_file differs from the "
                                 "receiving daemon's")
        elif not hmac.compare_digest(_bin(body, "token", NONCE_LEN), self._challenge):
            raise self._deny("identity", "the dialling daemon did not echo the probe sent to "
                             "the address it claims")
        assert self.peer is not None
        self._admit_peer(self.peer)
        self._move(Input.AUTH)
        self._out.append(encode_frame(PeerCommand.AUTH, _REPLY, 0, {}))
        self._events.append(Ready(self.peer))

    # -- initiator ------------------------------------------------------------------------

    def _on_reply(self, body: dict[str, Any]) -> None:
        peer, rail = _identity(body, len(self.me.addrs))
        assert self.expect is not None
        node, group, addr = self.expect
        if peer.key != (node, group) or rail != self.rail or peer.addrs[rail] != addr:
            if rail == self.rail and peer.addrs[rail] == addr:
                self.answered = peer.key
            raise self._deny("identity",
                f"the daemon at {_show(addr)} answers as node {peer.node:016x}/{peer.group} "
                f"rail {rail} at {_show(peer.addrs[rail])}, not as node {node:016x}/{group} "
                f"rail {self.rail}")
        self.peer = peer
        self._transcript = _transcript(self.me, peer, rail)
        self.peer_features = _features(body)
        if self.secret is not None:
            if "proof" not in body:
                raise self._deny("no_secret", f"the daemon at {_show(addr)} has no cluster "
                                 "secret (engine.secret_file) and this one has")
            challenge = _bin(body, "challenge", NONCE_LEN)
            proofs = [_bin(body, "proof", MAC_LEN)]
            if "previous_proof" in body:
                proofs.append(_bin(body, "previous_proof", MAC_LEN))
            shared = [self.keys.match(p, lambda k: _mac(k, RESPONDER_LABEL, self.nonce,
                                                        challenge, self._transcript))
                      for p in proofs]
            found = next((k for k in shared if k is not None), None)
            if found is None:
                raise self._deny("wrong_secret", f"the daemon at {_show(addr)} did not prove "
                                 "the cluster secret: its engine.secret_file differs from "
                                 "this daemon's")
            self._move(Input.HELLO_REPLY)
            self._challenge = challenge
            self.secret = found  # AUTH proves the secret both ends hold
            self._send_auth()
            return
        if "proof" in body:
            raise self._deny("no_secret", f"the daemon at {_show(addr)} requires a cluster "
                             "secret (engine.secret_file) and this one has none")
        if self._token is not None:
            self._move(Input.HELLO_REPLY)
            self._send_auth()
        else:
            self._move(Input.REPLY_BEFORE_TOKEN)

    def _deny(self, reason: str, message: str) -> Unauthorized:
        self.reason = reason
        return Unauthorized(message)

    def _admit_peer(self, peer: PeerIdentity) -> None:
        try:
            self._admit(peer)
        except TransferdError:
            self.reason = "identity"  # it contradicts what the peer book holds
            raise

    def _send_auth(self) -> None:
        if self.secret is not None:
            body = {"mac": _mac(self.secret, INITIATOR_LABEL, self._challenge, self.nonce,
                                self._transcript)}
        else:
            assert self._token is not None
            body = {"token": self._token}
        self._out.append(encode_frame(PeerCommand.AUTH, 0, 0, body))

    def _hello_body(self) -> dict[str, Any]:
        return {"v": VERSION, "node": self.me.node, "group": self.me.group,
                "rail": self.rail, "addrs": list(self.me.addrs)}


def node_of(groups: Sequence[Sequence[bytes]]) -> int:
    """A daemon's node id without a cluster secret: its every group's rail addresses,
    hashed (so an id names the daemon that listens there, and nobody else)."""
    raw = msgpack.packb([list(g) for g in groups])
    return int.from_bytes(hashlib.sha256(NODE_LABEL + raw).digest()[:8], "big") or 1


def _check_node(peer: PeerIdentity, groups: Any) -> None:
    """Without a secret: the HELLO's ``all`` lists this group's addresses among its
    daemon's, and the node id it claims is theirs."""
    if (type(groups) is not list or not 1 <= len(groups) <= MAX_GROUPS
            or not all(type(g) is list and 1 <= len(g) <= MAX_RAILS
                       and all(type(a) is bytes and 0 < len(a) <= MAX_ADDR_LEN for a in g)
                       for g in groups)):
        raise BadFrame(f"peer handshake: 'all' must be 1 to {MAX_GROUPS} lists of its "
                       "groups' addresses (bytes)")
    if peer.group >= len(groups) or tuple(groups[peer.group]) != peer.addrs:
        raise BadFrame(f"peer handshake: 'all' does not list group {peer.group}'s "
                       "addresses as 'addrs' does")
    if node_of(groups) != peer.node:
        raise Unauthorized(
            f"the peer claims node {peer.node:016x}, which is not its addresses' "
            f"({node_of(groups):016x}): without a cluster secret a daemon's node id is "
            "the hash of its rails' addresses, so no process can take another's")


def _features(body: dict[str, Any]) -> frozenset[str]:
    """A HELLO reply's ``features`` (none when absent); BadFrame when it is not a short
    list of short names."""
    got = body.get("features")
    if got is None:
        return frozenset()
    if (type(got) is not list or len(got) > MAX_FEATURES
            or not all(type(f) is str and len(f) <= MAX_FEATURE_LEN for f in got)):
        raise BadFrame(f"peer handshake: 'features' must be at most {MAX_FEATURES} names "
                       f"(str, at most {MAX_FEATURE_LEN} characters)")
    return frozenset(got)


def parse_probe(body: dict[str, Any]) -> tuple[bytes, bytes]:
    """(nonce, token) of a PROBE frame."""
    return _bin(body, "nonce", NONCE_LEN), _bin(body, "token", NONCE_LEN)


def _transcript(initiator: PeerIdentity, responder: PeerIdentity, rail: int) -> bytes:
    return bytes(msgpack.packb([VERSION, initiator.node, initiator.group,
                                list(initiator.addrs), rail, responder.node,
                                responder.group, list(responder.addrs)]))


def _reason(exc: TransferdError) -> str:
    """The reason of a failure that did not name one (transferd.authlog.REASONS)."""
    if isinstance(exc, Timeout):
        return "timeout"
    if type(exc) is BadRequest:
        return "config"  # rail counts, a rail dialled on another
    return "protocol"


def _refused(body: dict[str, Any]) -> TransferdError:
    err = error_from_body(body)
    err.message = f"the peer refused the handshake: {err.message}"
    return err


def _show(addr: bytes) -> str:
    """An address for a message: as text where it is text, else hex."""
    try:
        text = addr.decode()
    except UnicodeDecodeError:
        return addr.hex()
    return text if text.isprintable() else addr.hex()
