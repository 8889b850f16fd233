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
import enum
import ipaddress
import logging
import socket
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transferd.logs import peer_warning
from transferd.memory.staging import GatedLanding
from transferd.parts import MAX_MESSAGE, SendPart, Transfer, WritePart
from transferd.protocol.errors import (
    BadRequest,
    NoHello,
    OutOfMemory,
    PeerUnreachable,
    TransferdError,
    error_from_body,
)
from transferd.protocol.frames import DISCARD, Frame, Sink
from transferd.protocol.peer import PeerCommand, WriteHeader, parse_ref
from transferd.protocol.peer_handshake import (
    MAX_HANDSHAKE_BODY,
    PeerHandshake,
    Probe,
    Ready,
    Role,
    State,
    parse_probe,
)
from transferd.protocol.values import NetAddr, tcp_rail

from .base import Domain, DomainOptions, Receiver
from .stream import FramedStream

if TYPE_CHECKING:
    from transferd.engine.regions import Region
    from transferd.memory import Ref

log = logging.getLogger("transferd.domain")

CONNECT_TIMEOUT = 10.0
# Inbound links still in their handshake, per rail: past this new ones are
# closed at once (each costs a 4 KiB body, and without a secret one probe).
MAX_HANDSHAKING = 64
# After the handshake: an ACK carries an error message at most; a WRITE names
# up to 4096 pages (plan.PAGES_PER_FRAME is 256).
MAX_ACK_BODY = 64 * 1024
# The decoder's buffer before the handshake is done: a header and a 4 KiB body
# (a stranger's connection costs this, not a 256 KiB read buffer).
PRE_AUTH_BUFFER = 8192
MAX_BODY = 1 << 20
MAX_PAYLOAD = 1 << 40


def rail_bytes(host: str, port: int) -> bytes:
    """A TCP rail's address as the opaque bytes NetAddrs and the handshake carry."""
    return tcp_rail(host, port)


def parse_rail(raw: bytes) -> tuple[str, int]:
    """The (host, port) of :func:`rail_bytes`; BadRequest unless an IP and a port 1-65535."""
    try:
        text = raw.decode("ascii")
        host, _, port = text.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        return check_rail(host, int(port))
    except (UnicodeDecodeError, ValueError):
        raise BadRequest(f"not a TCP rail address: {raw!r}") from None


def check_rail(host: str, port: int) -> tuple[str, int]:
    """(host, port) if ``host`` is an IP address and ``port`` in 1-65535, else BadRequest."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise BadRequest(f"rail host {host!r} is not an IP address") from None
    if type(port) is not int or not 1 <= port <= 65535:
        raise BadRequest(f"rail port {port!r} is outside 1-65535")
    return host, port


class LinkState(enum.Enum):
    CONNECTING = "connecting"  # connecting, then the handshake
    READY = "ready"
    # Over the stream's high watermark: new parts wait until it drains below
    # the low one, so a slow peer holds our views, not a growing send queue.
    PAUSED = "paused"
    CLOSED = "closed"


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(256)
    sock.setblocking(False)
    return sock


def _peername(sock: socket.socket) -> Any:
    try:
        return sock.getpeername()
    except OSError:
        return None


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
        self.loop.add_reader(self._listener.fileno(), self._accept)

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
        if not self.closing:
            self.link_to(dst)

    # -- outbound -----------------------------------------------------------------

    def link_to(self, dst: NetAddr) -> PeerLink:
        key = (dst.node, dst.group, dst.rails[0])
        link = self._links.get(key)
        if link is None or link.state is LinkState.CLOSED:
            link = PeerLink(self, dst)
            self._links[key] = link
        return link

    def post(self, part: WritePart | SendPart, transfer: Transfer) -> None:
        if self.closing:
            transfer.part_done(PeerUnreachable(f"rail {self.rail} is closed"))
            return
        self.link_to(part.dst).submit(part, transfer)

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
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self.host, 0))
            sock.setblocking(False)
            timeout = self.group.handshake_timeout_s
            await asyncio.wait_for(self.loop.sock_connect(sock, (host, port)), timeout)
            await asyncio.wait_for(self.loop.sock_sendall(sock, data), timeout)
        except (TimeoutError, OSError) as exc:
            log.info("rail %d: probe to %s:%d failed: %s", self.rail, host, port, exc)
        finally:
            sock.close()

    # -- inbound ------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("rail %d: accept failed: %s", self.rail, exc)
                return
            if len(self._handshaking) >= MAX_HANDSHAKING:
                sock.close()
                continue
            link = InboundLink(self, sock)
            if not link.stream.closed:
                self._inbound.add(link)
                self._handshaking.add(link)

    def handshake_done(self, link: InboundLink) -> None:
        self._handshaking.discard(link)

    def inbound_closed(self, link: InboundLink) -> None:
        self._inbound.discard(link)
        self._handshaking.discard(link)

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        self.loop.remove_reader(self._listener.fileno())
        self._listener.close()
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
        self._task = domain.loop.create_task(self._connect())

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
            await asyncio.wait_for(
                self.domain.loop.sock_connect(sock, (host, port)), CONNECT_TIMEOUT
            )
        except (TimeoutError, OSError) as exc:
            sock.close()
            self.close(PeerUnreachable(
                f"rail {self.domain.rail}: cannot connect to {host}:{port}: {exc or 'timed out'}"
            ))
            return
        if self.state is LinkState.CLOSED:
            sock.close()
            return
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
            # A configuration mismatch stays a BAD_REQUEST; the rest is a link
            # that could not be made.
            kind = BadRequest if type(exc) is BadRequest else PeerUnreachable
            self.close(kind(f"link to {self.dst} rail {self.domain.rail}: {exc.message}"))
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
        self._send_waiting()

    def submit(self, part: WritePart | SendPart, transfer: Transfer) -> None:
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
        if transfer is not None:
            err = None if frame.body.get("ok") is True else error_from_body(frame.body)
            transfer.part_done(err)

    def _on_close(self, exc: BaseException | None) -> None:
        reason = f": {exc}" if exc else ""
        self.close(PeerUnreachable(f"link to {self.dst} rail {self.domain.rail} closed{reason}"))

    def close(self, error: TransferdError) -> None:
        if self.state is LinkState.CLOSED:
            return
        self.state = LinkState.CLOSED
        if not getattr(self.domain, "closing", False):  # no warning at shutdown
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


class InboundLink:
    """A peer's connection to this rail: the handshake, then its writes land here.

    The first frame may instead be a PROBE (a responder checking that we listen
    where one of our links says we do): it is handed to that link and this
    connection closed.
    """

    def __init__(self, domain: TcpDomain, sock: socket.socket) -> None:
        self.domain = domain
        self.peer: tuple[int, int] | None = None
        self._error: TransferdError | None = None
        self._write: WriteHeader | None = None
        # The write landing now (admitted by its region): let go once its
        # bytes are in place, or the link dies under it.
        self._landing: Ref | None = None
        # A write into device memory being received: (DeviceIO, staging chunks, pages).
        self._staged: tuple[Any, list[Any], list[tuple[int, int]]] | None = None
        g = domain.group
        self.hs = PeerHandshake(Role.RESPONDER, g.identity, domain.rail, g.secret,
                                domain.loop.time(), timeout=g.handshake_timeout_s,
                                admit=g.bind_peer)
        # A stranger costs one 4 KiB body at most, and this long.
        self.stream = FramedStream(
            domain.loop, sock, on_frame=self._on_frame, on_close=self._on_close,
            sink=self._sink, max_body=MAX_HANDSHAKE_BODY, max_payload=0,
            buffer_size=PRE_AUTH_BUFFER,
        )
        self._timer: asyncio.TimerHandle | None = domain.loop.call_at(
            self.hs.deadline, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if not self.hs.done:
            try:
                self.hs.tick(self.domain.loop.time())
            except TransferdError as exc:
                log.info("rail %d: %s", self.domain.rail, exc.message)
                self.close()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.stream.close()

    def _sink(self, frame: Frame) -> Sink:
        self._error = None
        self._write = None
        if self.peer is None:  # (the decoder takes no payload before the handshake)
            self._error = NoHello("peer handshake first")
            return DISCARD
        g = self.domain.group
        try:
            if frame.cmd == PeerCommand.WRITE:
                self._write = WriteHeader.parse(frame.body)
                region = g.region(self._write.rkey, self.domain.rail)
                io = g.device_io(region)
                if io is not None and frame.payload_len:
                    return self._stage(g, io, region, frame)
                views, self._landing = g.check_write(region, self.peer, self._write,
                                                     frame.payload_len, self._abort)
                return views
            if frame.cmd == PeerCommand.SEND:
                parse_ref(frame.body)
                if frame.payload_len > MAX_MESSAGE:
                    # Collected in memory: a size only the sender vouches for is
                    # checked before anything is allocated for it.
                    raise BadRequest(f"message of {frame.payload_len} bytes is over the "
                                     f"limit of {MAX_MESSAGE}")
                return None
        except TransferdError as exc:
            self._error = exc
            return DISCARD
        self._error = BadRequest(f"unexpected peer frame 0x{frame.cmd:02x}")
        return DISCARD

    def _stage(self, g: Receiver, io: Any, region: Region, frame: Frame) -> Sink:
        """A WRITE into device memory: its payload is received into pinned staging.

        The chunks come from the group's bounded pool.  This link takes only
        chunks that are free now (a sink cannot wait) and, after each device
        write, stops reading until that write's chunks are back (see
        :meth:`_land_device`), so a link waits for staging instead of
        anything growing.  A payload larger than the whole pool is refused.
        """
        assert self._write is not None and self.peer is not None
        pool = io.pool
        need = -(-frame.payload_len // pool.chunk_size)
        if need > pool.capacity:
            raise BadRequest(f"a write of {frame.payload_len} bytes into {region.buffer.device} "
                             f"memory is larger than its staging ({pool.capacity} x "
                             f"{pool.chunk_size} bytes)")
        pages, admitted = g.check_device_write(region, self.peer, self._write,
                                               frame.payload_len, self._abort)
        chunks: list[Any] = []
        for _ in range(need):
            got = pool.try_acquire()
            if got is None:
                for c in chunks:
                    pool.release(c)
                admitted.release()
                raise OutOfMemory(f"staging of {region.buffer.device} is taken "
                                  f"({pool.in_use} of {pool.capacity} chunks in use)")
            chunks.append(got)
        self._landing = admitted
        self._staged = (io, chunks, pages)
        left = frame.payload_len
        views = []
        for c in chunks:
            k = min(left, c.size)
            views.append(c.view[:k])
            left -= k
        return views

    def _land_device(self, frame: Frame, write: WriteHeader, landing: Ref | None) -> None:
        """The payload is in staging: H2D copies, and count and ACK only after their event.

        Until then the region's admission (``landing``) is held and this link
        reads nothing more (exact framing: the next frame stays in the socket).
        """
        assert self._staged is not None
        io, chunks, pages = self._staged
        self._staged = None
        gate = GatedLanding(io.stream, io.waiter, io.pool)
        per_chunk: list[list[tuple[int, int, int]]] = [[] for _ in chunks]
        step = io.pool.chunk_size
        pos = 0
        for dev, n in pages:
            while n:
                ci, off = divmod(pos, step)
                k = min(n, step - off)
                per_chunk[ci].append((dev, off, k))
                dev, n, pos = dev + k, n - k, pos + k
        left = [len(chunks)]
        loop, g, body, nbytes = self.domain.loop, self.domain.group, frame.body, frame.payload_len
        peer = self.peer
        assert peer is not None

        def copied() -> None:  # on the event waiter's thread, once per chunk
            left[0] -= 1
            if left[0]:
                return
            loop.call_soon_threadsafe(done)

        def done() -> None:
            if landing is not None:
                landing.release()
            error: TransferdError | None = None
            try:
                g.landed(peer, write, nbytes)
            except TransferdError as exc:
                error = exc
            self.stream.resume_reading()
            self._ack(body, error)

        self.stream.pause_reading()
        try:
            for chunk, pieces in zip(chunks, per_chunk, strict=True):
                gate.land(chunk, pieces, copied)
        except BaseException:
            self.stream.resume_reading()
            raise

    def _ack(self, body: dict[str, Any], error: TransferdError | None) -> None:
        op, part = body.get("op"), body.get("part")
        reply = {"op": op if type(op) is int else -1, "part": part if type(part) is int else -1}
        reply.update({"ok": True} if error is None else error.to_body())
        self.stream.send(PeerCommand.ACK, 0, 0, reply)

    def _on_frame(self, frame: Frame) -> None:
        if self.peer is None:
            self._handshake(frame)
            return
        error = self._error if frame.payload_len else None
        write, self._error, self._write = self._write, None, None
        landing, self._landing = self._landing, None
        if self._staged is not None and write is not None:
            try:
                self._land_device(frame, write, landing)
                return
            except TransferdError as exc:
                error = exc
        if landing is not None:
            # Every byte is in place (the frame is whole): the region may go.
            landing.release()
        g = self.domain.group
        if frame.cmd == PeerCommand.WRITE:
            if error is None:
                try:
                    if write is None:  # no payload: the sink was not asked
                        write = WriteHeader.parse(frame.body)
                        region = g.region(write.rkey, self.domain.rail)
                        g.check_write(region, self.peer, write, 0)[1].release()
                    g.landed(self.peer, write, frame.payload_len)
                except TransferdError as exc:
                    error = exc
            if error is not None:
                g.refused(error)
                peer_warning("peer write refused", self.peer[0], self.domain.rail,
                             _peername(self.stream.sock), error)
            self._ack(frame.body, error)
        elif frame.cmd == PeerCommand.SEND:
            if error is None:
                try:
                    parse_ref(frame.body)
                except TransferdError as exc:
                    error = exc
            if error is not None:
                self._ack(frame.body, error)
                return
            # Acknowledged when a client has the message, which may be later
            # (it waits for a receive) and on another thread.  Its sender is
            # the peer this link authenticated, whatever the frame says.
            body, loop = frame.body, self.domain.loop

            def ack(err: TransferdError | None) -> None:
                loop.call_soon_threadsafe(self._delivered, body, err)

            g.deliver(self.peer, bytes(frame.payload or b""), ack)
        else:
            self.close()

    def _handshake(self, frame: Frame) -> None:
        d = self.domain
        if frame.cmd == PeerCommand.PROBE and self.hs.state is State.AWAIT_HELLO:
            try:
                nonce, token = parse_probe(frame.body)
            except TransferdError:
                self.close()
                return
            d.probe_arrived(nonce, token)
            self.close()
            return
        try:
            self.hs.receive(frame, d.loop.time())
        except TransferdError as exc:
            log.info("rail %d: peer handshake refused: %s", d.rail, exc.message)
            self.stream.send_raw(self.hs.data_to_send())
            self.close()
            return
        self.stream.send_raw(self.hs.data_to_send())
        for ev in self.hs.events():
            if isinstance(ev, Probe):
                if not d.send_probe(ev.addr, ev.data):
                    self.close()
                    return
            elif isinstance(ev, Ready):
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                d.handshake_done(self)
                self.peer = ev.peer.key
                # An authenticated peer's writes carry their pages' bytes.
                self.stream.decoder.max_body = MAX_BODY
                self.stream.decoder.max_payload = MAX_PAYLOAD
                self.stream.decoder.grow_buffer()

    def _delivered(self, body: dict[str, Any], error: TransferdError | None) -> None:
        if error is None:
            self.domain.group.delivered()
        self._ack(body, error)

    def _abort(self) -> None:
        # From any thread: the link is closed on its worker, and no more lands.
        self.domain.loop.call_soon_threadsafe(self.stream.close,
                                              PeerUnreachable("region deregistered"))

    def _on_close(self, exc: BaseException | None) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:  # closed mid-payload: the chunks go back unused
            for chunk in staged[1]:
                staged[0].pool.release(chunk)
        landing, self._landing = self._landing, None
        if landing is not None:
            landing.release()  # the socket is closed: no more of it lands
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.domain.inbound_closed(self)
