"""A verbs rail's links to peers: the peer link core over TCP, then RC traffic.

Per peer and direction, one TCP connection to the peer's rail address (the host and
port in its NetAddr) carries, in order, what the sans-IO core of
:mod:`transferd.protocol.peer_link` says, driven by the same
:class:`~transferd.domains.link_io.SocketLink` as a tcp rail's links:

1. the peer handshake (HELLO, AUTH, and without a cluster secret a PROBE to the
   address the initiator claims): the peer proves the cluster secret, is bound in the
   group's peer book, and an initiator checks it reached who it dialled;
2. then one SETUP frame each way (the core's SETUP state): the initiator's
   :class:`~.exchange.RailSetup` (its two queue pairs for this peer), the
   responder's in reply after it created and connected its own; the initiator
   connects, and both ends are READY;
3. then nothing more on it: writes go by RDMA, messages and their ACKs by RC SEND in
   the peer plane's own frames (:mod:`transferd.protocol.peer_wire`, one frame a
   message); any other frame on the TCP connection ends the link, and its end tears
   the queue pairs down and fails what was in flight.

This is where the article's ConnectX Domain uses a UD queue pair (docs/rdma.md: a
choice; the queue pair numbers come from a peer that authenticated).
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from typing import TYPE_CHECKING, Any

from transferd.logs import peer_warning
from transferd.parts import ReadPart, SendPart, Transfer, WritePart
from transferd.preauth import Ticket, Why
from transferd.protocol.errors import BadRequest, PeerUnreachable, TransferdError
from transferd.protocol.peer_ext import encode_ext
from transferd.protocol.peer_handshake import SEND_EXT, Probe, Ready
from transferd.protocol.peer_inbound import InboundLink
from transferd.protocol.peer_link import (
    Event,
    LinkState,
    ProbeArrived,
    SetUp,
)
from transferd.protocol.peer_outbound import OutboundLink
from transferd.protocol.peer_wire import ACK, SEND, encode_ack, encode_send
from transferd.protocol.values import NetAddr
from transferd.rdma.exchange import RailSetup, check_pair

from ..link_io import SocketLink
from ..rails import parse_rail
from .messages import MSG_LEN

if TYPE_CHECKING:
    from .domain import QpEnd, VerbsDomain

CONNECT_TIMEOUT = 10.0
# A message as parse_message gives it: (cmd, op, part, a SEND's payload, an ACK's error
# or a SEND's refusal, a SEND's trace id).
Message = tuple[int, int, int, Any, TransferdError | None, bytes | None]


class _SetupLink:
    """What OutLink and InLink share: the core over TCP, and two queue pairs."""

    domain: VerbsDomain
    core: OutboundLink | InboundLink
    io: SocketLink | None = None
    send: QpEnd | None = None
    write: QpEnd | None = None
    _timer: asyncio.TimerHandle | None = None

    @property
    def state(self) -> LinkState:
        return self.core.state

    def _make_qps(self) -> RailSetup:
        from .domain import MSG_DEPTH, WRITE_RECV_DEPTH, QpEnd

        self.send = QpEnd(self.domain, self, write=False)
        # Our own write queue pair is never written to with an immediate: no receives.
        self.write = QpEnd(self.domain, self, write=True, receives=isinstance(self, InLink))
        me = self.domain.port.links.identity
        choice = self.domain.nic.choice
        return RailSetup(me.node, me.group, self.domain.rail, len(me.addrs), self.send.info,
                         self.write.info, MSG_DEPTH, WRITE_RECV_DEPTH, MSG_LEN,
                         choice.max_msg, choice.rd_atomic[1])

    def _connect_qps(self, mine: RailSetup, raw: bytes) -> RailSetup:
        theirs = RailSetup.from_bytes(raw)
        check_pair(mine, theirs)
        assert self.send is not None and self.write is not None
        self.send.connect(theirs.send_qp)
        self.write.connect(theirs.write_qp, theirs.read_depth)
        return theirs

    def _setup_timer(self) -> None:
        """The set-up gets as long as the handshake had."""
        self._timer = self.domain.loop.call_later(
            self.domain.port.links.handshake_timeout_s, self._setup_late)

    def _setup_late(self) -> None:
        self._timer = None
        if self.core.state is not LinkState.READY:
            self.close(PeerUnreachable(f"verbs rail {self.domain.rail}: no set-up from the "
                                       "peer in time"))

    def _close_qps(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for qp in (self.send, self.write):
            if qp is not None:
                qp.close()
        self.send = self.write = None
        if self.io is not None:
            self.io.close(None)

    def close(self, error: TransferdError) -> None:
        raise NotImplementedError

    def link_closed(self, link: SocketLink, error: TransferdError | None) -> None:
        self.close(error or PeerUnreachable("set-up connection closed"))


class OutLink(_SetupLink):
    """Our queue pairs towards one peer's rail: our writes and messages go out here."""

    def __init__(self, domain: VerbsDomain, dst: NetAddr) -> None:
        self.domain = domain
        self.dst = dst
        loop = domain.loop
        self.core = core = domain.port.links.outbound(domain.rail, dst, loop.time())
        core.label = f"verbs link to {dst} rail {domain.rail}"
        self._waiting: deque[tuple[WritePart | SendPart | ReadPart, Transfer]] = deque()
        self._pending: dict[tuple[int, int], Transfer] = {}
        self._setup: RailSetup | None = None
        self._closed = False
        self._task = loop.create_task(self._connect())

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
                                       f"{str(exc) or 'timed out'}"))
            return
        if self._closed:
            sock.close()
            return
        core = self.core
        assert isinstance(core, OutboundLink)
        core.connected(d.loop.time())
        links = d.port.links
        if links.secret is None and not links.probes.expect(core.nonce, self.probed):
            sock.close()
            self.close(PeerUnreachable(f"verbs rail {d.rail}: too many links wait for a "
                                       "probe"))
            return
        self.io = SocketLink(d.loop, sock, core, self)
        self.io.start()

    def probed(self, token: bytes) -> None:
        """Our listener got the PROBE for this link's handshake (no cluster secret)."""
        if self.io is not None:
            assert isinstance(self.core, OutboundLink)
            self.core.probe(token, self.domain.loop.time())
            self.io._after()

    def link_event(self, link: SocketLink, event: Event) -> None:
        if isinstance(event, Ready):
            assert isinstance(self.core, OutboundLink)
            self.domain.port.links.probes.forget(self.core.nonce)
            try:
                self._setup = self._make_qps()
            except TransferdError as exc:
                self.close(exc)
                return
            self.core.send_setup(self._setup.to_bytes())
            self._setup_timer()
        elif isinstance(event, SetUp):
            if event.error is not None or self._setup is None:
                self.close(event.error or BadRequest("verbs set-up before ours"))
                return
            try:
                self._connect_qps(self._setup, event.blob)
            except TransferdError as exc:
                self.close(exc)
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.core.carrier_ready()
            waiting, self._waiting = self._waiting, deque()
            for part, transfer in waiting:
                self._send(part, transfer)

    def submit(self, part: WritePart | SendPart | ReadPart, transfer: Transfer) -> None:
        if self.core.state is LinkState.READY:
            self._send(part, transfer)
        elif self._closed or self.core.closed:
            transfer.fail(PeerUnreachable(f"verbs link to {self.dst} is closed"))
        else:
            self._waiting.append((part, transfer))

    def _send(self, part: WritePart | SendPart | ReadPart, transfer: Transfer) -> None:
        if transfer.finished:
            return
        assert self.write is not None and self.send is not None
        if isinstance(part, WritePart | ReadPart):
            sender = self.domain.sender
            try:
                if isinstance(part, ReadPart):
                    # On our write queue pair: the peer's end of it serves READs.
                    sender.read(self.write, part, transfer)
                else:
                    sender.write(self.write, part, transfer)
            except TransferdError as exc:  # a part no work request can carry
                transfer.fail(exc)
            return
        key = (part.op, part.index)
        self._pending[key] = transfer

        def sent(err: TransferdError | None) -> None:
            if err is not None and self._pending.pop(key, None) is transfer:
                transfer.fail(err)

        head = encode_send(part.op, part.index, len(part.msg))
        if part.trace is not None and SEND_EXT in self.core.hs.peer_features:
            traced = encode_send(part.op, part.index, len(part.msg),
                                 encode_ext(None, part.trace))
            if len(traced) + len(part.msg) <= MSG_LEN:
                head = traced  # (else the message as it is: its trace stays here)
        try:
            self.send.send_frame(head, part.msg, sent)
        except TransferdError as exc:
            self._pending.pop(key, None)
            transfer.fail(exc)

    def on_message(self, msg: Message) -> None:
        """An ACK for one of our messages (the peer's client has it, or cannot)."""
        cmd, op, part, _payload, error, _trace = msg
        if cmd != ACK:
            self.close(BadRequest(f"unexpected message 0x{cmd:02x} on a verbs link"))
            return
        transfer = self._pending.pop((op, part), None)
        if transfer is not None:
            transfer.part_done(error)

    def close(self, error: TransferdError) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.core.closed:
            self.core.close(error)
        d = self.domain
        d.forget(self)
        if isinstance(self.core, OutboundLink):
            d.port.links.probes.forget(self.core.nonce)
        waiting, self._waiting = self._waiting, deque()
        pending, self._pending = self._pending, {}
        self._close_qps()
        self._task.cancel()
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
        self.ticket: Ticket | None = None  # its pre-auth slot, until the handshake ends
        port = domain.port
        self._closed = False
        # The TCP connection carries the handshake and the set-up only.
        self.core = port.links.inbound(domain.rail, port.landing, domain.loop.time(),
                                       stream_frames=False)
        self.io = SocketLink(domain.loop, sock, self.core, self)

    def link_event(self, link: SocketLink, event: Event) -> None:
        d = self.domain
        links = d.port.links
        if isinstance(event, Probe):
            if not links.probes.dial(self, d.host, event.addr, event.data,
                                     links.handshake_timeout_s, f"verbs rail {d.rail}"):
                self.close(BadRequest("the peer claims an address we cannot probe"))
        elif isinstance(event, ProbeArrived):
            links.probes.arrived(event.nonce, event.token)
        elif isinstance(event, Ready):
            links.probes.cancel(self)
            d.handshake_done(self)
            self.peer = event.peer.key
            self._setup_timer()
        elif isinstance(event, SetUp):
            if event.error is not None:
                self.close(event.error)
                return
            try:
                mine = self._make_qps()
                self._connect_qps(mine, event.blob)
            except TransferdError as exc:
                self.core.send_setup(None, exc)
                self.close(exc)
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.core.send_setup(mine.to_bytes())
            self.core.carrier_ready()

    def give_way(self, why: Why) -> None:
        """Its pre-auth slot was taken back (its deadline, or a newcomer's turn)."""
        self.close(PeerUnreachable(f"verbs rail {self.domain.rail}: a link in its "
                                   f"handshake closed: {why.value}"))

    def on_message(self, msg: Message) -> None:
        """A two-sided message from the peer this link authenticated."""
        cmd, op, part, payload, refusal, trace = msg
        if cmd != SEND or self.peer is None:
            self.close(BadRequest(f"unexpected message 0x{cmd:02x} on a verbs link"))
            return
        if refusal is not None:  # its extension block is wrong: refused, the link goes on
            peer_warning("peer message refused", self.peer[0], self.domain.rail,
                         self.io.peername() if self.io is not None else None, refusal, None)
            self._ack(op, part, refusal)
            return
        loop = self.domain.loop

        def ack(err: TransferdError | None) -> None:
            loop.call_soon_threadsafe(self._ack, op, part, err)

        self.domain.port.deliver(self.peer, bytes(payload), ack, self, trace=trace, op=op)

    def _ack(self, op: int, part: int, error: TransferdError | None) -> None:
        if self.send is None or self._closed:
            return
        try:
            self.send.send_frame(encode_ack(op, part, error), b"", None)
        except TransferdError as exc:
            self.close(exc)

    def close(self, error: TransferdError) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.core.closed:
            self.core.close(error)
        d = self.domain
        d.port.links.probes.cancel(self)
        if self.peer is not None:
            d.port.links.inbound_ended(self.core, d.rail,
                                       self.io.source if self.io is not None else None)
            d.port.sender_gone(self)  # its messages still waiting for a receive go
        d.inbound_closed(self)
        self._close_qps()
