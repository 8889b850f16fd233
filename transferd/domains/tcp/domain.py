"""The TCP Domain: one rail (one NIC) of a domain group, one TCP connection per peer link.

A rail binds its own local address, listens for peers' links, and keeps one
outbound link to each peer's matching rail, opened on first use and reused after.
Outbound links carry our WRITE and SEND frames and bring back ACKs; inbound links
receive peers' writes straight into regions.  Both are the sans-IO ends of
:mod:`transferd.protocol.peer_link` (handshake, frames, landing, ACKs, watermarks)
fed by a :class:`~transferd.domains.link_io.SocketLink`; what is here is what TCP
needs: dialling and its back-off, the descriptor budget, idle links reclaimed, the
listener and its bound on strangers in their handshake (:mod:`..strangers`), and the
probes a responder sends without a cluster secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import socket
from collections import OrderedDict
from typing import ClassVar

from transferd import tracing
from transferd.fds import AcceptGuard, LinkBudget, LogEvery
from transferd.logs import hostport, peer_warning, trace_fields
from transferd.parts import ReadPart, RegionInfo, SendPart, Transfer, WritePart
from transferd.preauth import Ticket, Why
from transferd.protocol.errors import (
    BadRequest,
    OverLimit,
    PeerUnreachable,
    TransferdError,
)
from transferd.protocol.peer_handshake import Probe, Ready
from transferd.protocol.peer_inbound import InboundLink
from transferd.protocol.peer_link import (
    Deliver,
    Event,
    Incoming,
    Land,
    LinkState,
    Placed,
    ProbeArrived,
    ReadsServed,
    Refused,
    StageRead,
)
from transferd.protocol.peer_outbound import OutboundLink
from transferd.protocol.values import NetAddr

from ..base import (
    Capabilities,
    Domain,
    DomainOptions,
    LinkKey,
    LinkStats,
    Port,
    count_links,
    link_key,
)
from ..link_io import HangupWatch, SocketLink
from ..rails import parse_rail, rail_bytes
from ..strangers import RailStrangers

log = logging.getLogger("transferd.domain")

CONNECT_TIMEOUT = 10.0
# A dial that failed (refused, timed out, or its handshake did) is not retried for a
# while: 0.25 s, doubling per failure to 10 s, forgotten once one works.
DIAL_BACKOFF_MIN_S = 0.25
DIAL_BACKOFF_MAX_S = 10.0
# Addresses whose dials are remembered as failed, per rail (oldest forgotten first).
MAX_DIAL_FAILURES = 4096
# What goes back on an inbound link is ACKs (and the handshake): a small kernel send
# buffer bounds the kernel memory an unread link holds as well.
ACK_SNDBUF = 128 * 1024
# Once a link answers READs it sends bulk data back: a send buffer like a dialled
# link's (what the kernel's autotuning reaches by default), not an ACK's.
READ_SNDBUF = 4 * 1024 * 1024
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)  # (Linux; not in typeshed)

def tune_link(sock: socket.socket, timeout_s: float) -> None:
    """A peer link's socket gives up on a dead path after about ``timeout_s``.

    TCP_USER_TIMEOUT: bytes unacknowledged (or unsent for a zero window) that long
    abort the connection, so a cut rail fails its parts over (failover.py) instead
    of waiting for the kernel's minutes of retransmissions.  Keepalives find a dead
    path while nothing is sent (an inbound link stalled mid-frame).
    """
    ms = max(1, int(timeout_s * 1000))
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, ms)
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(timeout_s)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(256)
    sock.setblocking(False)
    return sock


class TcpDomain(Domain):
    """One rail over TCP: a listener, one link per peer, the peer link core on each."""

    name: ClassVar[str] = "tcp"
    capabilities = Capabilities(sees_writes=True, counts_immediates=False, device_memory=True)

    def __init__(self, port: Port, rail: int, host: str, port_number: int = 0,
                 options: DomainOptions | None = None) -> None:
        self.port = port
        self.rail = rail
        self.host = host
        self.loop = port.loop
        self._listener = listen(host, port_number)
        self.port_number = self._listener.getsockname()[1]
        # Keyed by the peer and the address dialled: a link that authenticated is
        # used only for the address it authenticated at.
        self._links: dict[LinkKey, PeerLink] = {}
        self._inbound: set[InboundPeer] = set()
        # Inbound links held for a READ's checksum or staging, watched for their peer
        # going meanwhile (one epoll descriptor, made at the first).
        self.hangups = HangupWatch(self.loop)
        # Inbound links in their handshake: at most 64, 16 from one source, each for at
        # most the handshake timeout (strangers.py, the client ports' pre-auth admission).
        self.strangers = RailStrangers(f"rail {rail} ({host}:{self.port_number})",
                                       port.links.handshake_timeout_s)
        self.closing = False
        # Links that sent a part this turn of the loop (PeerLink.submit): one handle
        # ends the turn's burst of all of them (a scatter to many peers schedules one,
        # not one per peer).
        self._bursting: list[PeerLink] = []
        self._burst: asyncio.Handle | None = None
        # Links of every rail of the group share one budget of descriptors (fds.py).
        self.budget: LinkBudget = port.links.budget
        opts = options or DomainOptions()
        self.link_idle_s = opts.link_idle_s
        self.rail_timeout_s = opts.rail_timeout_s
        # Address dialled -> (failures in a row, no dial before, the last error, and who
        # answered there when it was not who was dialled: a dial of that one goes on).
        self._dial_failures: OrderedDict[
            bytes, tuple[int, float, TransferdError, tuple[int, int] | None]] = OrderedDict()
        self._log = LogEvery(log)
        self._sweeper: asyncio.TimerHandle | None = None
        self._guard = AcceptGuard(self.loop, self._listener, self._accept,
                                  f"rail {rail} ({host}:{self.port_number})", log)

    @property
    def address(self) -> bytes:
        return rail_bytes(self.host, self.port_number)

    def check_address(self, raw: bytes) -> None:
        parse_rail(raw)

    # -- memory: the region table's per-rail secret is this rail's rkey -----------------

    def register(self, region: RegionInfo) -> int:
        return region.rkeys[self.rail]

    def deregister(self, region: RegionInfo) -> None:
        # The region table forgets the rkeys and the region stops admitting.
        pass

    def connect(self, dst: NetAddr) -> None:
        if self.closing:
            return
        try:
            self.link_to(dst)
        except (OverLimit, PeerUnreachable, BadRequest) as exc:  # ahead of use: now and then
            self._log(logging.INFO, "rail %d: no link to %s now: %s", self.rail,
                      dst.rails[0].decode(errors="replace"), exc.message)

    # -- outbound -----------------------------------------------------------------------

    def link_to(self, dst: NetAddr) -> PeerLink:
        """The link to ``dst``, dialled if there is none (OverLimit past the link budget,
        PeerUnreachable while the address is in its dial back-off)."""
        key = link_key(dst)
        link = self._links.get(key)
        if link is not None and not link.closed:
            return link
        failed = self._dial_failures.get(dst.rails[0])
        now = self.loop.time()
        # A client naming this address under another identity (a forged NetAddr) backs
        # off dials as that identity only: the peer told us who it is, and a dial of it
        # is no retry of what failed (else one client denies the others this peer).
        if failed is not None and now < failed[1] and failed[3] != dst.key:
            # The last failure's kind: a peer that is unreachable, or one whose
            # handshake said no (BAD_REQUEST: another rail count, say).
            kind = BadRequest if type(failed[2]) is BadRequest else PeerUnreachable
            raise kind(
                f"rail {self.rail}: not dialling {dst.rails[0].decode(errors='replace')} "
                f"again for {failed[1] - now:.2f} s after {failed[0]} failed attempt(s): "
                f"{failed[2].message}")
        if not self._take_budget():
            raise OverLimit(f"rail {self.rail}: {self.budget.used} peer links open, the "
                            f"most this daemon holds (engine.max_links, and "
                            f"RLIMIT_NOFILE less engine.fd_reserve), none of them idle")
        link = PeerLink(self, dst)
        self._links[key] = link
        self._sweep_later()
        return link

    def post(self, part: WritePart | SendPart | ReadPart, transfer: Transfer) -> None:
        if self.closing:
            transfer.part_done(PeerUnreachable(f"rail {self.rail} is closed"))
            return
        link = self._links.get(link_key(part.dst))
        if link is None or link.closed:
            try:
                link = self.link_to(part.dst)
            except (OverLimit, PeerUnreachable, BadRequest) as exc:
                transfer.part_done(exc)
                return
        link.submit(part, transfer)

    def bursting(self, link: PeerLink) -> None:
        """``link`` sent the first part of its burst this turn: its end is due."""
        self._bursting.append(link)
        if self._burst is None:
            self._burst = self.loop.call_soon(self._burst_end)

    def _burst_end(self) -> None:
        self._burst = None
        links, self._bursting = self._bursting, []
        for link in links:
            link.burst_end()

    def dial_failed(self, addr: bytes, error: TransferdError,
                    answered: tuple[int, int] | None = None) -> None:
        """A dial of ``addr`` (or its handshake) failed: no new dial for a while (but of
        ``answered``, the identity the daemon there gave when it was not the one dialled)."""
        last = self._dial_failures.pop(addr, None)
        n = (last[0] if last is not None else 0) + 1
        delay = min(DIAL_BACKOFF_MIN_S * 2 ** (n - 1), DIAL_BACKOFF_MAX_S)
        self._dial_failures[addr] = (n, self.loop.time() + delay, error, answered)
        while len(self._dial_failures) > MAX_DIAL_FAILURES:
            self._dial_failures.popitem(last=False)

    def dial_worked(self, addr: bytes) -> None:
        self._dial_failures.pop(addr, None)

    def _reclaim_idle(self) -> bool:
        """Close the least recently used link with nothing in flight; False if none."""
        idle = [lk for lk in self._links.values() if lk.idle]
        if not idle:
            return False
        min(idle, key=lambda lk: lk.last_used).close(None)
        return True

    def _sweep_later(self) -> None:
        if self._sweeper is None and self.link_idle_s > 0 and not self.closing:
            self._sweeper = self.loop.call_later(max(0.1, self.link_idle_s / 4), self._sweep)

    def _sweep(self) -> None:
        """Close links unused for engine.link_idle_s (their descriptors go back)."""
        self._sweeper = None
        horizon = self.loop.time() - self.link_idle_s
        for link in [lk for lk in self._links.values() if lk.idle and lk.last_used < horizon]:
            link.close(None)
        if self._links:
            self._sweep_later()

    def drop_stalled(self, dst: NetAddr, error: TransferdError) -> None:
        """A transfer to ``dst`` failed (timed out, cancelled, refused): its link lets go
        of what it holds for parts that ended (the core drops their frames unsent, or
        cuts the link if one is half sent): a peer that reads nothing would keep their
        memory as long as the link lives."""
        link = self._links.get(link_key(dst))
        if link is not None:
            link.let_go_ended()

    def forget(self, link: PeerLink) -> None:
        key = link_key(link.dst)
        if self._links.get(key) is link:
            del self._links[key]

    def link_stats(self) -> LinkStats:
        return count_links([(_STATE_LABEL[lk.core.state], lk.core.waiting)
                            for lk in self._links.values()], len(self._inbound))

    def incoming(self) -> list[Incoming]:
        out = []
        for peer in list(self._inbound):
            core = peer.core
            now = core.incoming()
            if now is not None:
                out.append(now)
            answering = core.answering()
            if answering:
                # (Whose READs: the peer's end of the link, as an owner is named.)
                owner = hostport(peer.io.peername())
                out.extend(dataclasses.replace(a, owner=owner) for a in answering)
        return out

    # -- inbound ------------------------------------------------------------------------

    def _accept(self) -> None:
        for sock, addr in self._guard.accept_burst():
            if not self._take_budget():
                self._log(logging.WARNING, "rail %d: inbound link refused: %d of %d peer "
                          "links open", self.rail, self.budget.used, self.budget.limit)
                sock.close()
                continue
            tune_link(sock, self.rail_timeout_s)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, ACK_SNDBUF)
            peer = InboundPeer(self, sock)
            self._inbound.add(peer)
            peer.ticket = self.strangers.admit(str(addr[0]), self.loop.time(), peer)
            if peer.ticket is None:
                peer.io.close(None)

    def _take_budget(self) -> bool:
        """A descriptor of the link budget for a new link; at the cap an idle link of
        ours goes first, else the busiest source's oldest proved inbound link."""
        budget, room = self.budget, self.port.links.room
        if budget.take() or (self._reclaim_idle() and budget.take()):
            return True
        given = room.given
        if room.take():
            self._log(logging.WARNING, "rail %d: the link budget is full (%d peer links): "
                      "the oldest inbound link of the source holding the most closed for a "
                      "newcomer (%d so far)", self.rail, budget.limit, given + 1)
            return True
        return False

    def handshake_done(self, peer: InboundPeer) -> None:
        self.strangers.done(peer.ticket)
        source = peer.io.source
        self.port.links.room.add(str(source[0]) if source else "?", peer)

    def inbound_closed(self, peer: InboundPeer) -> None:
        self.port.links.room.discard(peer)
        if peer in self._inbound:
            self._inbound.discard(peer)
            self.budget.release()
        self.strangers.done(peer.ticket)

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        self._guard.close()
        self._listener.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for link in list(self._links.values()):
            link.close(PeerUnreachable("engine is shutting down"))
        for inbound in list(self._inbound):
            inbound.io.close(None)
        self.hangups.close()


_STATE_LABEL = {LinkState.CONNECTING: "connecting", LinkState.HANDSHAKE: "connecting",
                LinkState.SETUP: "connecting", LinkState.READY: "ready",
                LinkState.PAUSED: "paused", LinkState.CLOSED: "closed"}


class PeerLink:
    """Our link to one peer's rail: dialled, then the core's handshake, then our parts."""

    def __init__(self, domain: TcpDomain, dst: NetAddr) -> None:
        self.domain = domain
        self.dst = dst
        loop = domain.loop
        self.core: OutboundLink = domain.port.links.outbound(domain.rail, dst, loop.time())
        self.core.label = f"link to {dst} rail {domain.rail}"
        self.io: SocketLink | None = None
        self.last_used = loop.time()
        self._released = False
        self._idle = False  # closed for being idle (no warning)
        # A part sent this turn of the loop: the parts after it wait for the turn's end
        # and go together (one send for a burst of small writes, none delayed alone).
        self._bursting = False
        self._letting_go = False  # a let_go_ended is due this turn
        self._task = loop.create_task(self._connect())

    @property
    def closed(self) -> bool:
        return self.core.closed

    @property
    def idle(self) -> bool:
        return self.core.idle

    async def _connect(self) -> None:
        d = self.domain
        try:
            host, port = parse_rail(self.dst.rails[0])
        except BadRequest as exc:
            self.close(exc)
            return
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # Bind to our rail's address so the bytes leave by this rail's NIC.
            sock.bind((d.host, 0))
            sock.setblocking(False)
            await asyncio.wait_for(d.loop.sock_connect(sock, (host, port)),
                                   min(CONNECT_TIMEOUT, d.rail_timeout_s))
        except (TimeoutError, OSError) as exc:
            sock.close()
            err = PeerUnreachable(
                f"rail {d.rail}: cannot connect to {host}:{port}: {str(exc) or 'timed out'}")
            d.dial_failed(self.dst.rails[0], err)
            self.close(err)
            return
        if self.core.closed:
            sock.close()
            return
        tune_link(sock, d.rail_timeout_s)
        core = self.core
        core.connected(d.loop.time())
        if d.port.links.secret is None and not d.port.links.probes.expect(core.nonce,
                                                                         self.probed):
            sock.close()
            self.close(PeerUnreachable(f"rail {d.rail}: too many links wait for a probe"))
            return
        self.io = SocketLink(d.loop, sock, core, self, reset_on_close=True)
        self.io.start()

    def probed(self, token: bytes) -> None:
        """Our listener got the PROBE for this link's handshake (no cluster secret)."""
        if self.io is not None:
            self.core.probe(token, self.domain.loop.time())
            self.io._after()

    def submit(self, part: WritePart | SendPart | ReadPart, transfer: Transfer) -> None:
        core = self.core
        self.last_used = self.domain.loop.time()
        if type(part) is WritePart:
            core.write(transfer, part.op, part.index, part.rkey, part.addrs, part.lens,
                       part.src, part.imm, part.span, part.wid, part.again,
                       part.ext if part.verify or part.trace is not None else b"")
        elif type(part) is ReadPart:
            core.read(transfer, part.op, part.index, part.rkey, part.addrs, part.lens,
                      part.into, part.verify, part.trace)
        else:
            assert isinstance(part, SendPart)
            core.send(transfer, part.op, part.index, part.msg, part.trace)
        io = self.io
        if io is not None and core.state is LinkState.READY:
            if not self._bursting:
                # The first part of this turn goes now (a lone small write waits for
                # nothing); the turn's later parts wait in the core's output for the
                # domain's burst_end, which sends them in one go.
                io.flush()
                self._bursting = True
                self.domain.bursting(self)
        elif io is not None:
            io._after()
        elif core.completions:  # refused before the dial got anywhere
            done, core.completions = core.completions, []
            for token, err in done:
                token.part_done(err)

    def let_go_ended(self) -> None:
        """What the core holds for parts whose transfer ended goes, once this turn (the
        transfers that time out together cost one pass over what it holds)."""
        if not self._letting_go:
            self._letting_go = True
            self.domain.loop.call_soon(self._let_go)

    def _let_go(self) -> None:
        self._letting_go = False
        core = self.core
        core.let_go_ended()
        if self.io is not None:
            self.io._after()  # (a cut: its Closed; a paused link went on: its parts)
        elif core.closed:
            self.close(core.error)

    def burst_end(self) -> None:
        self._bursting = False
        io = self.io
        if io is not None and not io.closed and self.core.out.queued:
            io.flush()

    # -- what the core says ----------------------------------------------------------------

    def link_event(self, link: SocketLink, event: Event) -> None:
        if isinstance(event, Ready):
            d = self.domain
            d.port.links.probes.forget(self.core.nonce)
            d.dial_worked(self.dst.rails[0])
            self.core.carrier_ready()  # tcp: the stream is the carrier

    def link_closed(self, link: SocketLink, error: TransferdError | None) -> None:
        self._gone(error)

    def close(self, error: TransferdError | None) -> None:
        """Close the link, failing what it holds with ``error`` (None: idle, reclaimed)."""
        if error is None:
            self._idle = True
            error = PeerUnreachable(f"link to {self.dst} rail {self.domain.rail} was idle "
                                    "and closed")
        if self.io is not None:
            self.io.close(error)
            return
        self.core.close(error)
        self._task.cancel()
        self._gone(error)
        done, self.core.completions = self.core.completions, []
        for token, err in done:
            token.part_done(err)

    def _gone(self, error: TransferdError | None) -> None:
        if self._released:
            return
        self._released = True
        d = self.domain
        d.budget.release()
        d.forget(self)
        d.port.links.probes.forget(self.core.nonce)
        err = self.core.error or error
        if self.core.hs.error is not None and not self.core.authenticated \
                and err is not None:
            # Its handshake failed: back off.
            d.dial_failed(self.dst.rails[0], err, self.core.hs.answered)
        if err is not None and not d.closing and not self._idle:
            peer_warning("peer link broken", self.dst.node, d.rail,
                         self.dst.rails[0].decode(errors="replace") if self.dst.rails
                         else None, err)


class InboundPeer:
    """A peer's connection to this rail: the core's handshake, then its writes land."""

    def __init__(self, domain: TcpDomain, sock: socket.socket) -> None:
        self.domain = domain
        port = domain.port
        loop = domain.loop
        self.core: InboundLink = port.links.inbound(domain.rail, port.landing, loop.time(),
                                                    abort=self._abort)
        self.ticket: Ticket | None = None  # its pre-auth slot, until the handshake ends
        self.io = SocketLink(loop, sock, self.core, self, hangups=domain.hangups)

    def give_room(self) -> None:
        """A newcomer at the link budget's cap takes its descriptor (inbound_room.py)."""
        self.io.close(PeerUnreachable(f"rail {self.domain.rail}: closed to make room for "
                                      "a newer link (the link budget is full)"))

    def give_way(self, why: Why) -> None:
        """Its pre-auth slot was taken back (its deadline, or a newcomer's turn)."""
        self.io.close(PeerUnreachable(f"rail {self.domain.rail}: a link in its handshake "
                                      f"closed: {why.value}"))

    def link_event(self, link: SocketLink, event: Event) -> None:
        d = self.domain
        if type(event) is Deliver:
            # Acknowledged when a client has the message, which may be later (it waits
            # for a receive) and on another thread.  Its sender is the peer this link
            # authenticated, whatever the frame says.
            loop, ref, trace = d.loop, event.ref, event.trace

            def ack(err: TransferdError | None) -> None:
                loop.call_soon_threadsafe(self._delivered, ref, err, trace)

            if trace is not None and log.isEnabledFor(logging.DEBUG):
                log.debug("rail %d: message part %d of op %d from node %016x arrived (%d "
                          "bytes)", d.rail, ref[1], ref[0], event.peer[0],
                          len(event.message), extra=trace_fields(trace))
            d.port.deliver(event.peer, event.message, ack, self, trace=trace, op=ref[0])
        elif type(event) is Land:
            loop, land = d.loop, event

            def landed(err: TransferdError | None) -> None:  # any thread
                loop.call_soon_threadsafe(self._landed, land, err)

            try:
                event.admission.land(landed)
            except TransferdError as exc:
                self._landed(land, exc)
        elif type(event) is Placed and event.what == "read":
            if log.isEnabledFor(logging.DEBUG):  # (a traced READ's, with its trace id)
                peer = self.core.peer
                log.debug("rail %d: READ part %d of op %d from node %s answered (%d bytes)",
                          d.rail, event.ref[1], event.ref[0],
                          f"{peer.node:016x}" if peer else "?", event.nbytes,
                          extra=trace_fields(event.trace))
        elif type(event) is Placed:
            spans = tracing.SPANS
            if spans is not None:  # a traced part landed: its span (transferd.tracing)
                peer = self.core.peer
                spans.landed(event.ref[0], event.ref[1], event.nbytes, event.trace, d.rail,
                             peer.node if peer else None,
                             d.loop.time() - event.opened if event.opened is not None
                             else 0.0)
            if log.isEnabledFor(logging.DEBUG):
                peer = self.core.peer
                log.debug("rail %d: part %d of op %d from node %s landed (%d bytes)", d.rail,
                          event.ref[1], event.ref[0],
                          f"{peer.node:016x}" if peer else "?", event.nbytes,
                          extra=trace_fields(event.trace))
        elif type(event) is StageRead:
            loop, stage = d.loop, event

            def staged(err: TransferdError | None) -> None:  # the event waiter's thread
                loop.call_soon_threadsafe(self._staged, stage, err)

            try:
                event.source.land(staged)
            except TransferdError as exc:
                self._staged(stage, exc)
        elif type(event) is ReadsServed:
            sock = link.sock
            with contextlib.suppress(OSError):
                # (SO_SNDBUFFORCE past net.core.wmem_max where allowed, else what it allows.)
                try:
                    sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, READ_SNDBUF)
                except OSError:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, READ_SNDBUF)
        elif type(event) is Refused:
            peer = self.core.peer
            peer_warning(f"peer {event.what} refused", peer.node if peer else None, d.rail,
                         link.peername(), event.error, event.trace)
        elif isinstance(event, Probe):
            links = d.port.links
            if not links.probes.dial(self, d.host, event.addr, event.data,
                                     links.handshake_timeout_s, f"rail {d.rail}"):
                link.close(None)
        elif isinstance(event, ProbeArrived):
            d.port.links.probes.arrived(event.nonce, event.token)
        elif isinstance(event, Ready):
            d.handshake_done(self)
            d.port.links.probes.cancel(self)
            self.core.carrier_ready()

    def _delivered(self, ref: tuple[int, int], error: TransferdError | None,
                   trace: bytes | None = None) -> None:
        if trace is not None:
            # The receiver's record of a traced message's end (its log, with the trace id).
            peer = self.core.peer
            if error is not None:
                peer_warning("peer message refused", peer.node if peer else None,
                             self.domain.rail, self.io.peername(), error, trace)
            elif log.isEnabledFor(logging.DEBUG):
                log.debug("rail %d: message part %d of op %d from node %s delivered",
                          self.domain.rail, ref[1], ref[0],
                          f"{peer.node:016x}" if peer else "?", extra=trace_fields(trace))
        self.core.delivered(ref, error)
        self.io._after()

    def _landed(self, land: Land, error: TransferdError | None) -> None:
        self.core.landed(land, error)
        if not self.io.closed:
            self.io._after()

    def _staged(self, stage: StageRead, error: TransferdError | None) -> None:
        self.core.staged(stage, error)
        if not self.io.closed:
            self.io._after()

    def _abort(self) -> None:
        # From any thread: the link is closed on its worker, and no more lands.  Reset:
        # a graceful close would hand a reader that takes nothing the answers already
        # in the kernel's send queue at its own pace, a deregistered region's bytes
        # going out long after DEREG_MR returned (and the socket lingering as long).
        self.domain.loop.call_soon_threadsafe(
            functools.partial(self.io.close, PeerUnreachable("region deregistered"),
                              reset=True))

    def link_closed(self, link: SocketLink, error: TransferdError | None) -> None:
        d = self.domain
        d.port.links.probes.cancel(self)
        if error is not None and not self.core.authenticated:
            # (A failed handshake is counted and logged where it failed: authlog.)
            log.debug("rail %d: peer handshake ended: %s", d.rail, error.message)
        if self.core.authenticated:
            d.port.links.inbound_ended(self.core, d.rail, link.source)
            d.port.sender_gone(self)  # its messages still waiting go
        d.inbound_closed(self)
