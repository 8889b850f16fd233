"""The TCP Domain: one rail (one NIC) of a domain group.

A rail binds its own local address, listens for peers' links, and keeps one
outbound link to each peer's matching rail, opened on first use by the
worker and reused after.  Outbound links carry our WRITE and SEND frames and
bring back ACKs; inbound links receive peers' writes straight into regions.

Every link starts with the peer handshake (:mod:`transferd.protocol.
peer_handshake`); this module only feeds it bytes, sends what it queues,
runs its timer and, without a cluster secret, carries its PROBEs.  Until a
link is through, it takes a 4 KiB body and no payload, for a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
import struct
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transferd import authlog
from transferd.fds import AcceptGuard, LinkBudget, LogEvery
from transferd.logs import peer_warning
from transferd.parts import SendPart, Transfer, WritePart
from transferd.protocol.errors import (
    BadRequest,
    OverLimit,
    PeerUnreachable,
    TransferdError,
    error_from_body,
)
from transferd.protocol.frames import Frame
from transferd.protocol.peer import PeerCommand, parse_ref
from transferd.protocol.peer_handshake import (
    MAX_HANDSHAKE_BODY,
    PeerHandshake,
    Ready,
    Role,
)
from transferd.protocol.values import NetAddr

from .base import Domain, DomainOptions, Receiver
from .rails import parse_rail, rail_bytes
from .stream import FramedStream
from .tcp_inbound import PRE_AUTH_BUFFER, InboundLink

if TYPE_CHECKING:
    from transferd.engine.regions import Region

log = logging.getLogger("transferd.domain")

CONNECT_TIMEOUT = 10.0
# Inbound links still in their handshake, per rail: past this new ones are
# closed at once (each costs a 4 KiB body, and without a secret one probe).
MAX_HANDSHAKING = 64
# After the handshake: an ACK carries an error message at most; a WRITE names
# up to 4096 pages (plan.PAGES_PER_FRAME is 256).
MAX_ACK_BODY = 64 * 1024
# A dial that failed (refused, timed out, or its handshake did) is not retried
# for a while: 0.25 s, doubling per failure to 10 s, forgotten once one works.
DIAL_BACKOFF_MIN_S = 0.25
DIAL_BACKOFF_MAX_S = 10.0
# Addresses whose dials are remembered as failed, per rail (oldest forgotten first).
MAX_DIAL_FAILURES = 4096


async def dial_probe(loop: asyncio.AbstractEventLoop, bind_host: str, host: str, port: int,
                     data: bytes, timeout: float, label: str) -> None:
    """Connect from ``bind_host`` to ``host:port``, send ``data`` (a PROBE), hang up.

    Used by every Domain whose handshake runs over a rail's TCP link; a failure
    is only logged (the initiator's handshake then times out on its own).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((bind_host, 0))
        sock.setblocking(False)
        await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
        await asyncio.wait_for(loop.sock_sendall(sock, data), timeout)
    except (TimeoutError, OSError) as exc:
        log.info("%s: probe to %s:%d failed: %s", label, host, port, exc)
    finally:
        sock.close()


class LinkState(enum.Enum):
    CONNECTING = "connecting"  # connecting, then the handshake
    READY = "ready"
    # Over the stream's high watermark: new parts wait until it drains below
    # the low one, so a slow peer holds our views, not a growing send queue.
    PAUSED = "paused"
    CLOSED = "closed"


def tune_link(sock: socket.socket, timeout_s: float) -> None:
    """A peer link's socket gives up on a dead path after about ``timeout_s``.

    TCP_USER_TIMEOUT: bytes unacknowledged (or unsent for a zero window) that
    long abort the connection, so a cut rail fails its parts over (failover.py)
    instead of waiting for the kernel's minutes of retransmissions.  Keepalives
    find a dead path while nothing is sent (an inbound link stalled mid-frame).
    """
    ms = max(1, int(timeout_s * 1000))
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, ms)
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(timeout_s)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


def abort(sock: socket.socket | None) -> None:
    """Close with a reset: bytes still queued are dropped, never delivered late."""
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(256)
    sock.setblocking(False)
    return sock



LinkKey = tuple[int, int, bytes]


class TcpDomain(Domain):
    """One rail over TCP: a listener, one link per peer, the handshake on each."""

    name = "tcp"

    def __init__(self, group: Receiver, rail: int, host: str, port: int = 0,
                 options: DomainOptions | None = None) -> None:
        self.group = group
        self.rail = rail
        self.host = host
        self.loop = group.loop
        self._listener = _listen(host, port)
        self.port = self._listener.getsockname()[1]
        # Keyed by the peer and the address dialled: a link that authenticated
        # is used only for the address it authenticated at.
        self._links: dict[LinkKey, PeerLink] = {}
        self._inbound: set[InboundLink] = set()
        self.closing = False
        self._handshaking: set[InboundLink] = set()
        self._probes: dict[bytes, PeerLink] = {}
        self._probing: set[asyncio.Task[None]] = set()
        # Links of every rail of the group share one budget of descriptors (fds.py).
        budget = getattr(group, "link_budget", None)
        self.budget: LinkBudget = budget if budget is not None else LinkBudget(1 << 30)
        opts = options or DomainOptions()
        self.link_idle_s = opts.link_idle_s
        self.rail_timeout_s = opts.rail_timeout_s
        # Address dialled -> (failures in a row, no dial before, the last error).
        self._dial_failures: OrderedDict[bytes, tuple[int, float, TransferdError]] = \
            OrderedDict()
        self._log = LogEvery(log)
        self._sweeper: asyncio.TimerHandle | None = None
        self._guard = AcceptGuard(self.loop, self._listener, self._accept,
                                  f"rail {rail} ({host}:{self.port})", log)

    @property
    def address(self) -> bytes:
        return rail_bytes(self.host, self.port)

    def check_address(self, raw: bytes) -> None:
        parse_rail(raw)

    # -- memory: the region table's per-rail secret is this rail's rkey -----------------

    def register(self, region: Region) -> int:
        return region.rkeys[self.rail]

    def deregister(self, region: Region) -> None:
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

    # -- outbound -----------------------------------------------------------------

    def link_to(self, dst: NetAddr) -> PeerLink:
        """The link to ``dst``, dialled if there is none (OverLimit past the link budget,
        PeerUnreachable while the address is in its dial back-off)."""
        key = (dst.node, dst.group, dst.rails[0])
        link = self._links.get(key)
        if link is not None and link.state is not LinkState.CLOSED:
            return link
        failed = self._dial_failures.get(dst.rails[0])
        now = self.loop.time()
        if failed is not None and now < failed[1]:
            # The last failure's kind: a peer that is unreachable, or one whose
            # handshake said no (BAD_REQUEST: another rail count, say).
            kind = BadRequest if type(failed[2]) is BadRequest else PeerUnreachable
            raise kind(
                f"rail {self.rail}: not dialling {dst.rails[0].decode(errors='replace')} "
                f"again for {failed[1] - now:.2f} s after {failed[0]} failed attempt(s): "
                f"{failed[2].message}")
        if not self.budget.take() and not (self._reclaim_idle() and self.budget.take()):
            raise OverLimit(f"rail {self.rail}: {self.budget.used} peer links open, the "
                            f"most this daemon holds (engine.max_links, and "
                            f"RLIMIT_NOFILE less engine.fd_reserve), none of them idle")
        link = PeerLink(self, dst)
        self._links[key] = link
        self._sweep_later()
        return link

    def post(self, part: WritePart | SendPart, transfer: Transfer) -> None:
        if self.closing:
            transfer.part_done(PeerUnreachable(f"rail {self.rail} is closed"))
            return
        try:
            link = self.link_to(part.dst)
        except (OverLimit, PeerUnreachable, BadRequest) as exc:
            transfer.part_done(exc)
            return
        link.submit(part, transfer)

    def dial_failed(self, addr: bytes, error: TransferdError) -> None:
        """A dial of ``addr`` (or its handshake) failed: no new dial for a while."""
        last = self._dial_failures.pop(addr, None)
        n = (last[0] if last is not None else 0) + 1
        delay = min(DIAL_BACKOFF_MIN_S * 2 ** (n - 1), DIAL_BACKOFF_MAX_S)
        self._dial_failures[addr] = (n, self.loop.time() + delay, error)
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
        """A transfer to ``dst`` timed out: close its link if bytes still wait to go."""
        link = self._links.get((dst.node, dst.group, dst.rails[0]))
        if link is not None and link.stalled:
            link.close(error)

    def forget(self, link: PeerLink) -> None:
        key = (link.dst.node, link.dst.group, link.dst.rails[0])
        if self._links.get(key) is link:
            del self._links[key]

    # -- probes (no cluster secret) ---------------------------------------------------

    def expect_probe(self, nonce: bytes, link: PeerLink) -> None:
        self._probes[nonce] = link

    def forget_probe(self, link: PeerLink) -> None:
        if link.hs is not None and self._probes.get(link.hs.nonce) is link:
            del self._probes[link.hs.nonce]

    def probe_arrived(self, nonce: bytes, token: bytes) -> None:
        """A PROBE came to our listener: hand the token to the link that sent ``nonce``."""
        link = self._probes.get(nonce)
        if link is not None:
            link.probed(token)

    def send_probe(self, addr: bytes, data: bytes) -> bool:
        """Dial ``addr`` (the initiator's claimed rail), send a PROBE, hang up."""
        try:
            host, port = parse_rail(addr)
        except BadRequest as exc:
            log.info("rail %d: peer claims a bad address: %s", self.rail, exc.message)
            return False
        task = self.loop.create_task(self._probe(host, port, data))
        self._probing.add(task)
        task.add_done_callback(self._probing.discard)
        return True

    async def _probe(self, host: str, port: int, data: bytes) -> None:
        await dial_probe(self.loop, self.host, host, port, data,
                         self.group.handshake_timeout_s, f"rail {self.rail}")

    # -- inbound ------------------------------------------------------------------

    def _accept(self) -> None:
        for sock, _ in self._guard.accept_burst():
            if len(self._handshaking) >= MAX_HANDSHAKING or not self.budget.take():
                self._log(logging.WARNING, "rail %d: inbound link refused: %d handshaking, "
                          "%d of %d peer links open", self.rail, len(self._handshaking),
                          self.budget.used, self.budget.limit)
                sock.close()
                continue
            tune_link(sock, self.rail_timeout_s)
            link = InboundLink(self, sock)
            if not link.stream.closed:
                self._inbound.add(link)
                self._handshaking.add(link)
            else:
                self.budget.release()

    def handshake_done(self, link: InboundLink) -> None:
        self._handshaking.discard(link)

    def inbound_closed(self, link: InboundLink) -> None:
        if link in self._inbound:
            self._inbound.discard(link)
            self.budget.release()
        self._handshaking.discard(link)

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
            inbound.close()
        for task in list(self._probing):
            task.cancel()


class PeerLink:
    """Our connection to one peer's rail: the handshake first, then our parts."""

    def __init__(self, domain: TcpDomain, dst: NetAddr) -> None:
        self.domain = domain
        self.dst = dst
        self.state = LinkState.CONNECTING
        self.stream: FramedStream | None = None
        self.hs: PeerHandshake | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: deque[tuple[WritePart | SendPart, Transfer]] = deque()
        self._pending: dict[tuple[int, int], Transfer] = {}
        self.last_used = domain.loop.time()
        self._task = domain.loop.create_task(self._connect())

    @property
    def idle(self) -> bool:
        """Through its handshake, with nothing waiting, in flight or unsent."""
        return (self.state is LinkState.READY and not self._pending and not self._waiting
                and self.stream is not None and self.stream.queued == 0)

    async def _connect(self) -> None:
        try:
            host, port = parse_rail(self.dst.rails[0])
        except BadRequest as exc:
            self.close(exc)
            return
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # Bind to our rail's address so the bytes leave by this rail's NIC.
            sock.bind((self.domain.host, 0))
            sock.setblocking(False)
            await asyncio.wait_for(self.domain.loop.sock_connect(sock, (host, port)),
                                   min(CONNECT_TIMEOUT, self.domain.rail_timeout_s))
        except (TimeoutError, OSError) as exc:
            sock.close()
            err = PeerUnreachable(
                f"rail {self.domain.rail}: cannot connect to {host}:{port}: {exc or 'timed out'}")
            self.domain.dial_failed(self.dst.rails[0], err)
            self.close(err)
            return
        if self.state is LinkState.CLOSED:
            sock.close()
            return
        tune_link(sock, self.domain.rail_timeout_s)
        # Until the peer proved itself what comes back is small and never carries
        # a payload (ACKs never do): a frame that claims one breaks the link.
        self.stream = FramedStream(
            self.domain.loop, sock, on_frame=self._on_frame, on_close=self._on_close,
            max_body=MAX_HANDSHAKE_BODY, max_payload=0, buffer_size=PRE_AUTH_BUFFER,
        )
        self.stream.on_pause = self._pause
        self.stream.on_resume = self._resume
        d = self.domain
        now = d.loop.time()
        self.hs = PeerHandshake(
            Role.INITIATOR, d.group.identity, d.rail, d.group.secret, now,
            timeout=d.group.handshake_timeout_s,
            expect=(self.dst.node, self.dst.group, rail_bytes(host, port)),
            admit=d.group.bind_peer)
        self.hs.start()
        d.expect_probe(self.hs.nonce, self)
        self._timer = d.loop.call_at(self.hs.deadline, self._tick)
        self.stream.send_raw(self.hs.data_to_send())

    @property
    def stalled(self) -> bool:
        """Parts wait, or bytes are queued unsent (views of their sources held)."""
        return bool(self._waiting) or (self.stream is not None and self.stream.queued > 0)

    def _tick(self) -> None:
        if self.hs is not None and not self.hs.done:
            self._handshake(lambda hs: hs.tick(self.domain.loop.time()))

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
            # A configuration mismatch stays a BAD_REQUEST; the rest is a link
            # that could not be made.
            kind = BadRequest if type(exc) is BadRequest else PeerUnreachable
            err = kind(f"link to {self.dst} rail {self.domain.rail}: {exc.message}")
            self.domain.dial_failed(self.dst.rails[0], err)
            self.close(err)
            return
        assert self.stream is not None
        self.stream.send_raw(hs.data_to_send())
        if any(isinstance(ev, Ready) for ev in hs.events()):
            self._ready()

    def _ready(self) -> None:
        assert self.stream is not None
        self.domain.forget_probe(self)
        if self._timer is not None:
            self._timer.cancel()
        self.stream.decoder.max_body = MAX_ACK_BODY
        self.stream.decoder.grow_buffer(2 * MAX_ACK_BODY)
        self.state = LinkState.READY
        self.domain.dial_worked(self.dst.rails[0])
        self._send_waiting()

    def submit(self, part: WritePart | SendPart, transfer: Transfer) -> None:
        self.last_used = self.domain.loop.time()
        if self.state is LinkState.READY:
            self._send(part, transfer)
        elif self.state is LinkState.CLOSED:
            transfer.fail(PeerUnreachable(f"link to {self.dst} is closed"))
        else:
            self._waiting.append((part, transfer))

    def _pause(self) -> None:
        if self.state is LinkState.READY:
            self.state = LinkState.PAUSED

    def _resume(self) -> None:
        if self.state is LinkState.PAUSED:
            self.state = LinkState.READY
            self._send_waiting()

    def _send_waiting(self) -> None:
        # Sending may cross the high watermark again: stop there.
        while self._waiting and self.state is LinkState.READY:
            part, transfer = self._waiting.popleft()
            self._send(part, transfer)

    def _send(self, part: WritePart | SendPart, transfer: Transfer) -> None:
        assert self.stream is not None
        if transfer.finished:
            return
        self._pending[(part.op, part.index)] = transfer
        if isinstance(part, WritePart):
            body: dict[str, Any] = {
                "op": part.op, "part": part.index, "rkey": part.rkey,
                "addrs": part.addrs, "lens": part.lens,
            }
            if part.imm is not None:
                body["imm"] = part.imm
            if part.span is not None:
                body["span"] = part.span
            if part.wid is not None:
                body["wid"] = part.wid
            if part.again:
                body["again"] = True
            self.stream.send(PeerCommand.WRITE, 0, 0, body, part.src)
        else:
            self.stream.send(PeerCommand.SEND, 0, 0, {"op": part.op, "part": part.index},
                             [memoryview(part.msg)])

    def _on_frame(self, frame: Frame) -> None:
        if self.state is LinkState.CONNECTING:
            self._handshake(lambda hs: hs.receive(frame, self.domain.loop.time()))
            return
        if frame.cmd != PeerCommand.ACK:
            self.close(BadRequest(f"unexpected peer frame 0x{frame.cmd:02x} on a link"))
            return
        try:
            key = parse_ref(frame.body)
        except TransferdError as exc:
            self.close(PeerUnreachable(f"link to {self.dst}: a malformed ACK: {exc.message}"))
            return
        transfer = self._pending.pop(key, None)
        self.last_used = self.domain.loop.time()
        if transfer is not None:
            err = None if frame.body.get("ok") is True else error_from_body(frame.body)
            transfer.part_done(err)

    def _on_close(self, exc: BaseException | None) -> None:
        reason = f": {exc}" if exc else ""
        self.close(PeerUnreachable(f"link to {self.dst} rail {self.domain.rail} closed{reason}"))

    def close(self, error: TransferdError | None) -> None:
        """Close the link, failing what it holds with ``error`` (None: idle, reclaimed)."""
        if self.state is LinkState.CLOSED:
            return
        self.state = LinkState.CLOSED
        self.domain.budget.release()
        if error is None:
            error = PeerUnreachable(f"link to {self.dst} rail {self.domain.rail} was idle "
                                    "and closed")
        elif not getattr(self.domain, "closing", False):  # no warning at shutdown
            if self.stream is not None and type(error) is PeerUnreachable:
                # Its parts may be re-sent on another rail: none of this link's
                # bytes may arrive after them.
                abort(self.stream.sock)
            peer_warning("peer link broken", self.dst.node, self.domain.rail,
                         self.dst.rails[0].decode(errors="replace") if self.dst.rails
                         else None, error)
        if self._timer is not None:
            self._timer.cancel()
        self.domain.forget(self)
        self.domain.forget_probe(self)
        if self.stream is not None:
            self.stream.close()
        waiting, self._waiting = self._waiting, deque()
        pending, self._pending = self._pending, {}
        for _, transfer in waiting:
            transfer.fail(error)
        for transfer in pending.values():
            transfer.fail(error)
