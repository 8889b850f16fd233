"""A verbs rail's links to peers: the authenticated peer handshake over TCP, then the
queue pair set-up, then RC traffic.

Per peer and direction, one TCP connection to the peer's rail address (the host and
port in its NetAddr) carries, in order:

1. the peer handshake of :mod:`transferd.protocol.peer_handshake` (HELLO, AUTH, and
   without a cluster secret a PROBE to the address the initiator claims), exactly as a
   tcp rail runs it: the peer proves the cluster secret, is bound in the group's peer
   book, and an initiator checks it reached who it dialled;
2. then SETUP (``SETUP_CMD``) both ways: the initiator's :class:`~.exchange.RailSetup`
   (its two queue pairs for this peer), the responder's in the reply after it created
   and connected its own; the initiator connects;
3. then nothing more: the connection stays open as long as the queue pairs, and its end
   tears them down and fails what was in flight.

This is where the article's ConnectX Domain uses a UD queue pair (docs/rdma.md: a
choice; the queue pair numbers come from a peer that authenticated).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transferd import authlog
from transferd.parts import SendPart, Transfer, WritePart
from transferd.protocol.errors import (
    BadRequest,
    PeerUnreachable,
    TransferdError,
    error_from_body,
)
from transferd.protocol.frames import Frame
from transferd.protocol.peer import PeerCommand
from transferd.protocol.peer_handshake import (
    MAX_HANDSHAKE_BODY,
    PeerHandshake,
    Probe,
    Ready,
    Role,
    State,
    parse_probe,
)
from transferd.protocol.values import NetAddr

from ..rails import parse_rail
from ..stream import FramedStream
from ..tcp_inbound import _peername
from .exchange import RailSetup, check_pair

if TYPE_CHECKING:
    from .domain import QpEnd, VerbsDomain

# The verbs set-up frame, after the handshake (in the peer plane's 0x40-0x4F).
SETUP_CMD = 0x4E
CONNECT_TIMEOUT = 10.0
_REPLY, _ERROR = 0x01, 0x02


class LinkState(enum.Enum):
    CONNECTING = "connecting"  # TCP, then the handshake, then the set-up
    READY = "ready"
    CLOSED = "closed"


class _SetupLink:
    """What OutLink and InLink share: the set-up connection and two queue pairs."""

    domain: VerbsDomain
    send: QpEnd | None = None
    write: QpEnd | None = None
    stream: FramedStream | None = None
    hs: PeerHandshake | None = None
    state = LinkState.CONNECTING
    _timer: asyncio.TimerHandle | None = None

    def _make_qps(self) -> RailSetup:
        from .domain import MSG_DEPTH, MSG_LEN, WRITE_RECV_DEPTH, QpEnd

        self.send = QpEnd(self.domain, self, write=False)
        # Our own write queue pair is never written to with an immediate: no receives.
        self.write = QpEnd(self.domain, self, write=True, receives=isinstance(self, InLink))
        g = self.domain.group
        return RailSetup(g.node, g.index, self.domain.rail, len(g.domains), self.send.info,
                         self.write.info, MSG_DEPTH, WRITE_RECV_DEPTH, MSG_LEN,
                         self.domain.nic.choice.max_msg)

    def _connect_qps(self, mine: RailSetup, raw: Any) -> RailSetup:
        if not isinstance(raw, bytes):
            raise BadRequest("verbs SETUP without a rail set-up")
        theirs = RailSetup.from_bytes(raw)
        check_pair(mine, theirs)
        assert self.send is not None and self.write is not None
        self.send.connect(theirs.send_qp)
        self.write.connect(theirs.write_qp)
        return theirs

    def _close_qps(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for qp in (self.send, self.write):
            if qp is not None:
                qp.close()
        self.send = self.write = None
        if self.stream is not None:
            self.stream.close()

    def close(self, error: TransferdError) -> None:
        raise NotImplementedError


class OutLink(_SetupLink):
    """Our queue pairs towards one peer's rail: our writes and messages go out here."""

    def __init__(self, domain: VerbsDomain, dst: NetAddr) -> None:
        self.domain = domain
        self.dst = dst
        self.state = LinkState.CONNECTING
        self._waiting: deque[tuple[WritePart | SendPart, Transfer]] = deque()
        self._pending: dict[tuple[int, int], Transfer] = {}
        self._setup: RailSetup | None = None
        self._task = domain.loop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            host, port = parse_rail(self.dst.rails[0])  # rails are address bytes
        except BadRequest as exc:
            self.close(exc)
            return
        d = self.domain
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((d.host, 0))
            sock.setblocking(False)
            await asyncio.wait_for(d.loop.sock_connect(sock, (host, port)), CONNECT_TIMEOUT)
        except (TimeoutError, OSError) as exc:
            sock.close()
            self.close(PeerUnreachable(f"verbs rail {d.rail}: cannot reach {host}:{port}: "
                                       f"{exc or 'timed out'}"))
            return
        if self.state is LinkState.CLOSED:
            sock.close()
            return
        self.stream = FramedStream(d.loop, sock, on_frame=self._on_frame,
                                   on_close=self._on_close, max_body=MAX_HANDSHAKE_BODY,
                                   max_payload=0)
        g = d.group
        self.hs = PeerHandshake(Role.INITIATOR, g.identity, d.rail, g.secret, d.loop.time(),
                                timeout=g.handshake_timeout_s,
                                expect=(self.dst.node, self.dst.group, self.dst.rails[0]),
                                admit=g.bind_peer)
        self.hs.start()
        d.expect_probe(self.hs.nonce, self)
        self._timer = d.loop.call_at(self.hs.deadline, self._tick)
        self.stream.send_raw(self.hs.data_to_send())

    def _tick(self) -> None:
        self._timer = None
        if self.state is LinkState.CONNECTING:
            if self.hs is not None and not self.hs.done:
                self._handshake(lambda hs: hs.tick(self.domain.loop.time()))
            else:  # the handshake is done but the SETUP reply never came
                self.close(PeerUnreachable(f"verbs link to {self.dst}: no SETUP reply"))

    def probed(self, token: bytes) -> None:
        """Our listener got the PROBE for this link's handshake (no cluster secret)."""
        self._handshake(lambda hs: hs.probe(token, self.domain.loop.time()))

    def _handshake(self, step: Callable[[PeerHandshake], None]) -> None:
        hs = self.hs
        if hs is None or self.state is LinkState.CLOSED:
            return
        try:
            step(hs)
        except TransferdError as exc:
            # Counted; the broken link's own WARNING names it.
            authlog.peer_failed(hs, self.dst.rails[0], self.domain.rail, emit=False)
            kind = BadRequest if type(exc) is BadRequest else PeerUnreachable
            self.close(kind(f"verbs link to {self.dst} rail {self.domain.rail}: "
                            f"{exc.message}"))
            return
        assert self.stream is not None
        self.stream.send_raw(hs.data_to_send())
        if any(isinstance(ev, Ready) for ev in hs.events()):
            self.domain.forget_probe(self)
            try:
                self._setup = self._make_qps()
            except TransferdError as exc:
                self.close(exc)
                return
            self.stream.send(SETUP_CMD, 0, 0, {"setup": self._setup.to_bytes()})
            if self._timer is not None:  # the SETUP reply gets the same time
                self._timer.cancel()
            self._timer = self.domain.loop.call_later(self.domain.group.handshake_timeout_s,
                                                      self._tick)

    def _on_frame(self, frame: Frame) -> None:
        if self.state is not LinkState.CONNECTING:
            self.close(BadRequest(f"unexpected set-up frame 0x{frame.cmd:02x}"))
            return
        if self.hs is not None and not self.hs.done:
            self._handshake(lambda hs: hs.receive(frame, self.domain.loop.time()))
            return
        if frame.cmd != SETUP_CMD or self._setup is None:
            self.close(BadRequest(f"unexpected set-up frame 0x{frame.cmd:02x}"))
            return
        if frame.is_error:
            self.close(error_from_body(frame.body))
            return
        try:
            self._connect_qps(self._setup, frame.body.get("setup"))
        except TransferdError as exc:
            self.close(exc)
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.state = LinkState.READY
        waiting, self._waiting = self._waiting, deque()
        for part, transfer in waiting:
            self._send(part, transfer)

    def submit(self, part: WritePart | SendPart, transfer: Transfer) -> None:
        if self.state is LinkState.READY:
            self._send(part, transfer)
        elif self.state is LinkState.CLOSED:
            transfer.fail(PeerUnreachable(f"verbs link to {self.dst} is closed"))
        else:
            self._waiting.append((part, transfer))

    def _send(self, part: WritePart | SendPart, transfer: Transfer) -> None:
        if transfer.finished:
            return
        assert self.write is not None and self.send is not None
        if isinstance(part, WritePart):
            try:
                self.domain.sender.write(self.write, part, transfer)
            except TransferdError as exc:  # a part no work request can carry
                transfer.fail(exc)
            return
        key = (part.op, part.index)
        self._pending[key] = transfer

        def sent(err: TransferdError | None) -> None:
            if err is not None and self._pending.pop(key, None) is transfer:
                transfer.fail(err)

        try:
            self.send.send_frame(PeerCommand.SEND, {"op": part.op, "part": part.index},
                                 part.msg, sent)
        except TransferdError as exc:
            self._pending.pop(key, None)
            transfer.fail(exc)

    def on_message(self, frame: Frame) -> None:
        """An ACK for one of our messages (the peer's client has it, or cannot)."""
        if frame.cmd != PeerCommand.ACK:
            self.close(BadRequest(f"unexpected message 0x{frame.cmd:02x} on a verbs link"))
            return
        key = (frame.body.get("op", -1), frame.body.get("part", -1))
        transfer = self._pending.pop(key, None)
        if transfer is not None:
            transfer.part_done(None if frame.body.get("ok") else error_from_body(frame.body))

    def _on_close(self, exc: BaseException | None) -> None:
        reason = f": {exc}" if exc else ""
        self.close(PeerUnreachable(f"verbs link to {self.dst} rail {self.domain.rail} "
                                   f"closed{reason}"))

    def close(self, error: TransferdError) -> None:
        if self.state is LinkState.CLOSED:
            return
        self.state = LinkState.CLOSED
        self.domain.forget(self)
        self.domain.forget_probe(self)
        waiting, self._waiting = self._waiting, deque()
        pending, self._pending = self._pending, {}
        self._close_qps()
        for _, transfer in waiting:
            transfer.fail(error)
        for transfer in pending.values():
            transfer.fail(error)


class InLink(_SetupLink):
    """A peer's queue pairs towards us: its writes land and its messages arrive here.

    The first frame may instead be a PROBE (a peer checking that we listen where one
    of our links says we do): it goes to that link and this connection is closed.
    """

    def __init__(self, domain: VerbsDomain, sock: socket.socket) -> None:
        self.domain = domain
        self.peer: tuple[int, int] | None = None
        self.state = LinkState.CONNECTING
        g = domain.group
        self.hs = PeerHandshake(Role.RESPONDER, g.identity, domain.rail, g.secret,
                                domain.loop.time(), timeout=g.handshake_timeout_s,
                                admit=g.bind_peer)
        self.addr = _peername(sock)  # for the handshake's failures (authlog)
        self.stream = FramedStream(domain.loop, sock, on_frame=self._on_frame,
                                   on_close=self._on_close, max_body=MAX_HANDSHAKE_BODY,
                                   max_payload=0)
        self._timer = domain.loop.call_at(self.hs.deadline, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self.state is LinkState.CONNECTING:
            hs = self.hs
            if hs is not None and not hs.done:
                with contextlib.suppress(TransferdError):
                    hs.tick(self.domain.loop.time())
                authlog.peer_failed(hs, self.addr, self.domain.rail)
            self.close(PeerUnreachable("verbs set-up not finished in time"))

    def _on_frame(self, frame: Frame) -> None:
        assert self.stream is not None and self.hs is not None
        d = self.domain
        if self.state is not LinkState.CONNECTING:
            self.close(BadRequest(f"unexpected set-up frame 0x{frame.cmd:02x}"))
            return
        if not self.hs.done:
            if frame.cmd == PeerCommand.PROBE and self.hs.state is State.AWAIT_HELLO:
                try:
                    nonce, token = parse_probe(frame.body)
                except TransferdError:
                    self.close(BadRequest("a malformed PROBE"))
                    return
                d.probe_arrived(nonce, token)
                self.close(PeerUnreachable("probe delivered"))
                return
            try:
                self.hs.receive(frame, d.loop.time())
            except TransferdError as exc:
                authlog.peer_failed(self.hs, self.addr, d.rail)
                self.stream.send_raw(self.hs.data_to_send())
                self.close(exc)
                return
            self.stream.send_raw(self.hs.data_to_send())
            for ev in self.hs.events():
                if isinstance(ev, Probe) and not d.send_probe(ev.addr, ev.data):
                    self.close(BadRequest("the peer claims an address we cannot probe"))
                    return
                if isinstance(ev, Ready):
                    self.peer = ev.peer.key
            return
        if frame.cmd != SETUP_CMD or self.peer is None:
            self.close(BadRequest(f"unexpected set-up frame 0x{frame.cmd:02x}"))
            return
        try:
            mine = self._make_qps()
            self._connect_qps(mine, frame.body.get("setup"))
        except TransferdError as exc:
            self.stream.send(SETUP_CMD, _REPLY | _ERROR, 0, exc.to_body())
            self.close(exc)
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.state = LinkState.READY
        self.stream.send(SETUP_CMD, _REPLY, 0, {"setup": mine.to_bytes()})

    def on_message(self, frame: Frame) -> None:
        """A two-sided message from the peer this link authenticated."""
        if frame.cmd != PeerCommand.SEND or self.peer is None:
            self.close(BadRequest(f"unexpected message 0x{frame.cmd:02x} on a verbs link"))
            return
        ref = {"op": frame.body.get("op"), "part": frame.body.get("part")}
        loop = self.domain.loop

        def ack(err: TransferdError | None) -> None:
            loop.call_soon_threadsafe(self._ack, ref, err)

        self.domain.group.deliver(self.peer, bytes(frame.payload or b""), ack, self)

    def _ack(self, ref: dict[str, Any], error: TransferdError | None) -> None:
        if self.send is None or self.state is LinkState.CLOSED:
            return
        body = dict(ref)
        body.update({"ok": True} if error is None else error.to_body())
        try:
            self.send.send_frame(PeerCommand.ACK, body, b"", None)
        except TransferdError as exc:
            self.close(exc)

    def _on_close(self, exc: BaseException | None) -> None:
        if self.state is not LinkState.CLOSED:  # the peer's close, not ours
            authlog.peer_hung_up(self.hs, self.addr, self.domain.rail)
        self.close(PeerUnreachable("set-up connection closed"))

    def close(self, error: TransferdError) -> None:
        if self.state is LinkState.CLOSED:
            return
        self.state = LinkState.CLOSED
        self.domain.group.sender_gone(self)  # its messages still waiting for a receive go
        self.domain.inbound_closed(self)
        self._close_qps()
