"""The TCP Domain's inbound side: a peer's link to one of our rails.

Split from :mod:`transferd.domains.tcp` (which accepts the connection and owns the
rail): the handshake as responder, then every WRITE checked against its region,
admitted, received straight into it (or into staging for device memory), counted
and acknowledged, and every SEND handed to the receiver.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING, Any

from transferd import authlog
from transferd.copies import COUNTING, count
from transferd.logs import peer_warning
from transferd.memory.staging import GatedLanding
from transferd.parts import MAX_MESSAGE
from transferd.protocol.errors import (
    BadRequest,
    NoHello,
    OutOfMemory,
    PeerUnreachable,
    TransferdError,
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

from .base import Receiver
from .stream import FramedStream

if TYPE_CHECKING:
    from transferd.engine.regions import Region
    from transferd.memory import Ref

    from .tcp import TcpDomain

log = logging.getLogger("transferd.domain")

# The decoder's buffer before the handshake is done: a header and a 4 KiB body
# (a stranger's connection costs this, not a 256 KiB read buffer).
PRE_AUTH_BUFFER = 8192
MAX_BODY = 1 << 20
MAX_PAYLOAD = 1 << 40
# ACKs not yet taken by the peer's socket: past the high watermark this link reads
# nothing more (a peer that writes without reading its ACKs holds itself back,
# not our memory), and resumes once they are down to the low one.
ACK_HIGH_WATER = 256 * 1024
ACK_LOW_WATER = 64 * 1024
# What goes back on an inbound link is ACKs (and the handshake): a small kernel
# send buffer bounds the kernel memory an unread link holds as well.
ACK_SNDBUF = 128 * 1024

def _peername(sock: socket.socket) -> Any:
    try:
        return sock.getpeername()
    except OSError:
        return None


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
        # The write being received carries a write id this link claimed (it must
        # land or be let go), or one already applied (acknowledged, not placed).
        self._claimed = False
        self._dup = False
        # The write landing now (admitted by its region): let go once its
        # bytes are in place, or the link dies under it.
        self._landing: Ref | None = None
        # A write into device memory being received: (DeviceIO, staging chunks, pages).
        self._staged: tuple[Any, list[Any], list[tuple[int, int]]] | None = None
        g = domain.group
        self.addr = _peername(sock)  # for the handshake's failures (authlog)
        self._closed_here = False
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, ACK_SNDBUF)
        self.hs = PeerHandshake(Role.RESPONDER, g.identity, domain.rail, g.secret,
                                domain.loop.time(), timeout=g.handshake_timeout_s,
                                admit=g.bind_peer)
        # A stranger costs one 4 KiB body at most, and this long.
        self.stream = FramedStream(
            domain.loop, sock, on_frame=self._on_frame, on_close=self._on_close,
            sink=self._sink, max_body=MAX_HANDSHAKE_BODY, max_payload=0,
            buffer_size=PRE_AUTH_BUFFER,
        )
        self.stream.high_water, self.stream.low_water = ACK_HIGH_WATER, ACK_LOW_WATER
        self.stream.on_pause, self.stream.on_resume = self._hold, self._unhold
        # Reasons to read nothing now: ACKs unread (above), a device write's copies.
        self._holds = 0
        self._timer: asyncio.TimerHandle | None = domain.loop.call_at(
            self.hs.deadline, self._tick)

    def _hold(self) -> None:
        self._holds += 1
        self.stream.pause_reading()

    def _unhold(self) -> None:
        self._holds -= 1
        if not self._holds:
            self.stream.resume_reading()

    def _tick(self) -> None:
        self._timer = None
        if not self.hs.done:
            try:
                self.hs.tick(self.domain.loop.time())
            except TransferdError:
                authlog.peer_failed(self.hs, self.addr, self.domain.rail)
                self.close()

    def close(self) -> None:
        self._closed_here = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.stream.close()

    def _sink(self, frame: Frame) -> Sink:
        self._error = None
        self._write = None
        self._claimed = self._dup = False
        if self.peer is None:  # (the decoder takes no payload before the handshake)
            self._error = NoHello("peer handshake first")
            return DISCARD
        g = self.domain.group
        try:
            if frame.cmd == PeerCommand.WRITE:
                self._write = WriteHeader.parse(frame.body)
                if g.claim_write(self.peer, self._write):
                    self._dup = True  # applied before (a retry): read and dropped
                    return DISCARD
                self._claimed = self._write.wid is not None
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
            if self._claimed and self._write is not None:
                g.write_failed(self.peer, self._write)
            self._claimed = False
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
        gate = GatedLanding(io)
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

        faults: list[TransferdError] = []

        def copied(fault: TransferdError | None) -> None:  # on the event waiter's thread
            if fault is not None:
                faults.append(fault)
            left[0] -= 1
            if left[0]:
                return
            loop.call_soon_threadsafe(done)

        def done() -> None:
            if landing is not None:
                landing.release()
            error: TransferdError | None = faults[0] if faults else None
            if error is not None:  # the device failed a copy: nothing counts
                g.write_failed(peer, write)
            else:
                try:
                    g.landed_once(peer, write, nbytes)
                except TransferdError as exc:
                    error = exc
            self._unhold()
            self._ack(body, error)

        self._hold()
        try:
            for chunk, pieces in zip(chunks, per_chunk, strict=True):
                gate.land(chunk, pieces, copied)
        except BaseException:
            self._unhold()
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
        claimed, dup, self._claimed, self._dup = self._claimed, self._dup, False, False
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
            if dup:
                self._ack(frame.body, None)  # applied before: acknowledged, not again
                return
            if error is None:
                try:
                    if write is None:  # no payload: the sink was not asked
                        write = WriteHeader.parse(frame.body)
                        if g.claim_write(self.peer, write):
                            self._ack(frame.body, None)
                            return
                        claimed = write.wid is not None
                        region = g.region(write.rkey, self.domain.rail)
                        g.check_write(region, self.peer, write, 0)[1].release()
                    claimed = False  # landed_once lets go of the claim itself
                    g.landed_once(self.peer, write, frame.payload_len)
                except TransferdError as exc:
                    error = exc
            if claimed and write is not None:
                g.write_failed(self.peer, write)
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

            if COUNTING:
                count("peer.deliver", frame.payload_len)
            g.deliver(self.peer, bytes(frame.payload or b""), ack, self)
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
        except TransferdError:
            authlog.peer_failed(self.hs, self.addr, d.rail)
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
        if not self._closed_here:
            authlog.peer_hung_up(self.hs, self.addr, self.domain.rail)
        staged, self._staged = self._staged, None
        if staged is not None:  # closed mid-payload: the chunks go back unused
            for chunk in staged[1]:
                staged[0].pool.release(chunk)
        landing, self._landing = self._landing, None
        if landing is not None:
            landing.release()  # the socket is closed: no more of it lands
        if self._claimed and self._write is not None and self.peer is not None:
            self._claimed = False
            self.domain.group.write_failed(self.peer, self._write)  # a retry may land
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.peer is not None:
            self.domain.group.sender_gone(self)  # its messages still waiting go
        self.domain.inbound_closed(self)
