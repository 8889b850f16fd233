"""The TCP Domain: one rail (one NIC) of a domain group.

A rail binds its own local address, listens for peers' links, and keeps one
outbound link to each peer's matching rail, opened on first use by the
worker and reused after.  Outbound links carry our WRITE and SEND frames and
bring back ACKs; inbound links receive peers' writes straight into regions.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
from collections import deque
from typing import TYPE_CHECKING, Any

from transferd.engine.limits import MAX_MESSAGE
from transferd.engine.plan import SendPart, WritePart
from transferd.engine.transfer import Transfer
from transferd.logs import peer_warning
from transferd.memory import Ref
from transferd.protocol.errors import (
    BadRequest,
    PeerUnreachable,
    TransferdError,
    error_from_body,
)
from transferd.protocol.frames import DISCARD, Frame, Sink
from transferd.protocol.peer import PeerCommand
from transferd.protocol.values import NetAddr

from .stream import FramedStream

if TYPE_CHECKING:
    from .group import DomainGroup

log = logging.getLogger("transferd.domain")

CONNECT_TIMEOUT = 10.0


class LinkState(enum.Enum):
    CONNECTING = "connecting"
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


class TcpDomain:
    def __init__(self, group: DomainGroup, rail: int, host: str, port: int = 0) -> None:
        self.group = group
        self.rail = rail
        self.host = host
        self.loop = group.loop
        self._listener = _listen(host, port)
        self.port = self._listener.getsockname()[1]
        self._links: dict[tuple[int, int], PeerLink] = {}
        self._inbound: set[InboundLink] = set()
        self.closing = False
        self.loop.add_reader(self._listener.fileno(), self._accept)

    # -- outbound -----------------------------------------------------------------

    def link_to(self, dst: NetAddr) -> PeerLink:
        link = self._links.get(dst.key)
        if link is None or link.state is LinkState.CLOSED:
            link = PeerLink(self, dst)
            self._links[dst.key] = link
        return link

    def post(self, part: WritePart | SendPart, transfer: Transfer) -> None:
        self.link_to(part.dst).submit(part, transfer)

    def forget(self, link: PeerLink) -> None:
        if self._links.get(link.dst.key) is link:
            del self._links[link.dst.key]

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
            self._inbound.add(InboundLink(self, sock))

    def close(self) -> None:
        self.closing = True
        self.loop.remove_reader(self._listener.fileno())
        self._listener.close()
        for link in list(self._links.values()):
            link.close(PeerUnreachable("engine is shutting down"))
        for inbound in list(self._inbound):
            inbound.stream.close()


class PeerLink:
    """Our connection to one peer's rail."""

    def __init__(self, domain: TcpDomain, dst: NetAddr) -> None:
        self.domain = domain
        self.dst = dst
        self.state = LinkState.CONNECTING
        self.stream: FramedStream | None = None
        self._waiting: deque[tuple[WritePart | SendPart, Transfer]] = deque()
        self._pending: dict[tuple[int, int], Transfer] = {}
        self._task = domain.loop.create_task(self._connect())

    async def _connect(self) -> None:
        host, port = self.dst.rails[0]
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
        # What comes back on our link (HELLO, ACKs) never carries a payload: a
        # frame that claims one breaks the link instead of being buffered.
        self.stream = FramedStream(
            self.domain.loop, sock, on_frame=self._on_frame, on_close=self._on_close,
            max_payload=0,
        )
        self.stream.on_pause = self._pause
        self.stream.on_resume = self._resume
        g = self.domain.group
        self.stream.send(PeerCommand.HELLO, 0, 0, g.hello_body(self.domain.rail))
        # A peer that accepts and never answers must not keep our parts (and
        # the memory they send from) waiting forever.
        self.domain.loop.call_later(min(CONNECT_TIMEOUT, g.timeout_s), self._hello_timeout)

    def _hello_timeout(self) -> None:
        if self.state is LinkState.CONNECTING:
            self.close(PeerUnreachable(f"rail {self.domain.rail}: {self.dst} did not answer "
                                       "HELLO in time"))

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
                "op": part.op, "part": part.index, "parts": part.parts, "rkey": part.rkey,
                "addrs": part.addrs, "lens": part.lens, "count": part.count,
            }
            if part.imm is not None:
                body["imm"] = part.imm
            self.stream.send(PeerCommand.WRITE, 0, 0, body, part.src)
        else:
            self.stream.send(PeerCommand.SEND, 0, 0, {"op": part.op, "part": part.index},
                             [memoryview(part.msg)])

    def _on_frame(self, frame: Frame) -> None:
        if frame.cmd == PeerCommand.ACK:
            key = (frame.body.get("op", -1), frame.body.get("part", -1))
            transfer = self._pending.pop(key, None)
            if transfer is not None:
                err = None if frame.body.get("ok") else error_from_body(frame.body)
                transfer.part_done(err)
        elif frame.cmd == PeerCommand.HELLO and self.state is LinkState.CONNECTING:
            if frame.is_error:
                self.close(error_from_body(frame.body))
                return
            rails = frame.body.get("rails")
            mine = len(self.domain.group.domains)
            if rails != mine:
                self.close(BadRequest(
                    f"rail count mismatch: this daemon has {mine} rail(s), peer {self.dst} "
                    f"has {rails}; every peer must have the same number of NICs"))
                return
            self.state = LinkState.READY
            self._send_waiting()
        else:
            self.close(BadRequest(f"unexpected peer frame 0x{frame.cmd:02x}"))

    def _on_close(self, exc: BaseException | None) -> None:
        reason = f": {exc}" if exc else ""
        self.close(PeerUnreachable(f"link to {self.dst} rail {self.domain.rail} closed{reason}"))

    def close(self, error: TransferdError) -> None:
        if self.state is LinkState.CLOSED:
            return
        self.state = LinkState.CLOSED
        if not getattr(self.domain, "closing", False):  # no warning at shutdown
            peer_warning("peer link broken", self.dst.node, self.domain.rail,
                         self.dst.rails[0] if self.dst.rails else None, error)
        self.domain.forget(self)
        if self.stream is not None:
            self.stream.close()
        waiting, self._waiting = self._waiting, deque()
        pending, self._pending = self._pending, {}
        for _, transfer in waiting:
            transfer.fail(error)
        for transfer in pending.values():
            transfer.fail(error)


class InboundLink:
    """A peer's connection to this rail: its writes land here."""

    def __init__(self, domain: TcpDomain, sock: socket.socket) -> None:
        self.domain = domain
        self.peer: tuple[int, int] | None = None
        self._error: TransferdError | None = None
        # The write landing now (admitted by its region): let go once its
        # bytes are in place, or the link dies under it.
        self._landing: Ref | None = None
        self.stream = FramedStream(
            domain.loop, sock, on_frame=self._on_frame, on_close=self._on_close, sink=self._sink
        )

    def _sink(self, frame: Frame) -> Sink:
        self._error = None
        if self.peer is None:
            self._error = BadRequest("HELLO first")
            return DISCARD
        if frame.cmd == PeerCommand.WRITE:
            try:
                views, self._landing = self.domain.group.admit_write(
                    self.domain.rail, frame.body, frame.payload_len, self._abort)
                return views
            except TransferdError as exc:
                self._error = exc
                return DISCARD
        if frame.cmd == PeerCommand.SEND:
            if frame.payload_len > MAX_MESSAGE:
                # Collected in memory: a size only the sender vouches for is
                # checked before anything is allocated for it.
                self._error = BadRequest(
                    f"message of {frame.payload_len} bytes is over the limit of {MAX_MESSAGE}")
                return DISCARD
            return None
        self._error = BadRequest(f"unexpected peer frame 0x{frame.cmd:02x}")
        return DISCARD

    def _ack(self, body: dict[str, Any], error: TransferdError | None) -> None:
        reply = {"op": body.get("op"), "part": body.get("part")}
        reply.update({"ok": True} if error is None else error.to_body())
        self.stream.send(PeerCommand.ACK, 0, 0, reply)

    def _on_frame(self, frame: Frame) -> None:
        g = self.domain.group
        if frame.cmd == PeerCommand.HELLO and self.peer is None:
            body = frame.body
            rails = body.get("rails")
            if rails != len(g.domains):
                err = BadRequest(
                    f"rail count mismatch: peer has {rails} rail(s), this daemon "
                    f"{len(g.domains)}")
                self.stream.send(PeerCommand.HELLO, 0x02, 0, err.to_body())
                self.stream.close()
                return
            self.peer = (int(body.get("node", 0)), int(body.get("group", 0)))
            self.stream.send(PeerCommand.HELLO, 0, 0, g.hello_body(self.domain.rail))
            return
        error = self._error if frame.payload_len else None
        self._error = None
        landing, self._landing = self._landing, None
        if landing is not None:
            # Every byte is in place (the frame is whole): the region may go.
            landing.release()
        if self.peer is None:
            self.stream.close()
            return
        if frame.cmd == PeerCommand.WRITE:
            if error is None:
                try:
                    if not frame.payload_len:
                        g.write_views(self.domain.rail, frame.body, 0)
                    g.landed(self.peer, frame.body, frame.payload_len)
                except TransferdError as exc:
                    error = exc
            if error is not None:
                g.refused[error.code.value] = g.refused.get(error.code.value, 0) + 1
                peer_warning("peer write refused", self.peer[0], self.domain.rail,
                             _peername(self.stream.sock), error)
            self._ack(frame.body, error)
        elif frame.cmd == PeerCommand.SEND:
            if error is not None:
                self._ack(frame.body, error)
                return
            # Acknowledged when a client has the message, which may be later
            # (it waits for a receive) and on another thread.
            body, loop = frame.body, self.domain.loop

            def ack(err: TransferdError | None) -> None:
                loop.call_soon_threadsafe(self._delivered, body, err)

            g.deliver(self.peer, bytes(frame.payload or b""), ack)
        else:
            self.stream.close()

    def _delivered(self, body: dict[str, Any], error: TransferdError | None) -> None:
        if error is None:
            self.domain.group.messages_in += 1
        self._ack(body, error)

    def _abort(self) -> None:
        # From any thread: the link is closed on its worker, and no more lands.
        self.domain.loop.call_soon_threadsafe(self.stream.close,
                                              PeerUnreachable("region deregistered"))

    def _on_close(self, exc: BaseException | None) -> None:
        landing, self._landing = self._landing, None
        if landing is not None:
            landing.release()  # the socket is closed: no more of it lands
        self.domain._inbound.discard(self)
