"""The I/O loop of one peer link over a non-blocking socket: it feeds the sans-IO core.

:class:`SocketLink` owns the socket and nothing of the protocol: it receives into
what the core's :meth:`get_buffers` names (a write's pages, straight into the region,
or the core's buffer), tells the core what arrived, sends what the core's output
holds (``sendmsg`` over the views where the bytes lie), runs the handshake's timer,
follows the core's PAUSED state (an inbound link reads nothing while its ACKs go
unread, a device landing is in flight or a READ waits for its staging or checksum;
in that last case watching for its peer hanging up: :class:`HangupWatch`), completes
what the core says is done and hands the core's events to its owner (the Domain).
Used by the tcp Domain for its links, and by verbs for the TCP connection its queue
pairs are set up over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import struct
from typing import Any, Protocol

from transferd import authlog
from transferd.protocol.errors import PeerUnreachable, TransferdError
from transferd.protocol.peer_inbound import InboundLink
from transferd.protocol.peer_link import Closed, Event
from transferd.protocol.peer_outbound import OutboundLink

log = logging.getLogger("transferd.peer")

# Receives per readable callback before other sockets get a turn.
READS_PER_WAKEUP = 16
# The peer shut its side (a FIN) or reset: signalled while frames wait unread (Linux).
_RDHUP: int | None = getattr(select, "EPOLLRDHUP", None) if hasattr(select, "epoll") else None


class LinkOwner(Protocol):
    def link_event(self, link: SocketLink, event: Event) -> None:
        """An event of the core (Ready, Probe, ProbeArrived, Deliver, Land)."""

    def link_closed(self, link: SocketLink, error: TransferdError | None) -> None:
        """The link is over (its socket is closed)."""


def abort(sock: socket.socket) -> None:
    """Close with a reset: bytes still queued are dropped, never delivered late."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class HangupWatch:
    """Sockets of links that read nothing while a READ waits for its memory side (its
    checksum, its staging copy), watched for their peer hanging up.

    Not reading, such a link would not see a FIN or a reset until it read again, and
    what it waits for went on for nobody (a queue of abandoned 4000 MiB checksums ahead
    of an honest peer's).  Each socket is in one epoll set (per rail) for EPOLLRDHUP
    alone (a reset is EPOLLHUP or EPOLLERR, always reported): the frames a peer sends
    meanwhile stay in the kernel unread, the back-pressure as before.  The set's own
    descriptor is what the loop watches, made at the first link held so.  Where epoll
    has no EPOLLRDHUP (not Linux) nothing is watched: the link sees the end once it
    reads again.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ep: select.epoll | None = None  # made at the first link watched
        self._links: dict[int, SocketLink] = {}
        self._closed = False

    def watch(self, link: SocketLink) -> bool:
        """Watch ``link``'s socket until :meth:`unwatch`; False where it cannot be."""
        if _RDHUP is None or self._closed:
            return False
        if self._ep is None:
            try:
                self._ep = select.epoll()
            except OSError:  # (out of descriptors: the link waits as it did before)
                return False
            self._loop.add_reader(self._ep.fileno(), self._ready)
        try:
            self._ep.register(link.fileno, _RDHUP)
        except OSError:
            return False
        self._links[link.fileno] = link
        return True

    def unwatch(self, link: SocketLink) -> None:
        fd = link.fileno
        if self._links.get(fd) is link:
            del self._links[fd]
            if self._ep is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._ep.unregister(fd)

    def _ready(self) -> None:
        ep = self._ep
        if ep is None:
            return
        try:
            ready = ep.poll(0)
        except OSError:
            return
        for fd, events in ready:
            link = self._links.get(fd)
            if link is None:  # (gone meanwhile)
                with contextlib.suppress(OSError, ValueError):
                    ep.unregister(fd)
                continue
            link.hung_up(events)
            if self._links.get(fd) is link:  # (it did not close: no wake-up per turn)
                self.unwatch(link)

    def close(self) -> None:
        self._closed = True
        ep, self._ep = self._ep, None
        self._links.clear()
        if ep is not None:
            with contextlib.suppress(ValueError, OSError, RuntimeError):
                self._loop.remove_reader(ep.fileno())
            ep.close()


class SocketLink:
    """One core link (``core``: an OutboundLink or InboundLink) over ``sock``;
    ``hangups``: where an inbound link held for a READ's memory side is watched for its
    peer hanging up (:class:`HangupWatch`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 core: OutboundLink | InboundLink, owner: LinkOwner, *,
                 reset_on_close: bool = False, hangups: HangupWatch | None = None) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.loop = loop
        self.sock = sock
        self.core = core
        self.owner = owner
        # An outbound link whose parts may be re-sent elsewhere closes with a reset.
        self.reset_on_close = reset_on_close
        self.reset_on_cut = False  # this close is a cut: close(reset=True)
        self._fd = sock.fileno()
        self._outbound = isinstance(core, OutboundLink)
        self._writing = False
        self.closed = False
        self._reading = True
        self._peer_gone = False  # the other end closed (or broke) the connection
        self._hangups = hangups
        self._watched = False  # in ``hangups`` now
        # Who is at the other end, for a failed handshake's count and log (authlog).
        self.source: Any = self.peername()
        loop.add_reader(self._fd, self._readable)
        self._timer: asyncio.TimerHandle | None = loop.call_at(core.deadline, self._tick)

    def start(self) -> None:
        """Send what the core has to say first (an outbound link's HELLO)."""
        self._after()

    # -- receive ------------------------------------------------------------------------

    def _readable(self) -> None:
        core, sock = self.core, self.sock
        for _ in range(READS_PER_WAKEUP):
            bufs = core.get_buffers()
            try:
                if len(bufs) == 1:
                    want = len(bufs[0])
                    n = sock.recv_into(bufs[0])
                else:
                    want = sum(map(len, bufs))
                    n = sock.recvmsg_into(bufs)[0]
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._peer_gone = True
                self.close(PeerUnreachable(f"{self._what()} broken: {exc}"))
                return
            if not n:
                self._peer_gone = True
                self.close(PeerUnreachable(f"{self._what()} closed by the peer"))
                return
            try:
                core.received(n, self.loop.time())
            except Exception as exc:  # a bug, not the peer's doing: this link ends
                log.exception("peer link: frame handling failed")
                self.close(PeerUnreachable(f"{self._what()}: {exc!r}"))
                return
            if core.in_frame and not core.events and not core.out.queued:
                continue  # within a payload, nothing to hand on: read on
            self._after()
            if self.closed or not self._reading:
                return
            if n < want:
                # A short read between frames: the socket is empty, no need to ask again.
                # Within a payload more is coming: read on (one wake-up, many reads).
                return
        if core.in_frame and not self.closed:
            self._after()  # (nothing is due, but the last reads' state is handed on)

    def hung_up(self, events: int) -> None:
        """The peer shut its side or reset while this link read nothing (HangupWatch):
        the link ends as if it had read that end."""
        if self.closed:
            return
        self._peer_gone = True
        err = 0
        with contextlib.suppress(OSError):
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        self.close(PeerUnreachable(f"{self._what()} broken: {os.strerror(err)}" if err
                                   else f"{self._what()} closed by the peer"))

    @property
    def fileno(self) -> int:
        return self._fd

    def _tick(self) -> None:
        self._timer = None
        self.core.tick(self.loop.time())
        self._after()

    # -- after each step of the core ---------------------------------------------------

    def _after(self) -> None:
        """Hand on what the core produced: events, completions, bytes, reading state."""
        core = self.core
        if core.events:
            events, core.events = core.events, []
            for ev in events:
                if type(ev) is Closed:
                    self._closed(ev.error)
                else:
                    self.owner.link_event(self, ev)
        if self._outbound:
            done = core.completions  # type: ignore[union-attr]
            if done:
                core.completions = []  # type: ignore[union-attr]
                for token, err in done:
                    token.part_done(err)
        if self.closed:
            return
        if core.out.queued:
            if self._outbound or not core.acks_later:  # type: ignore[union-attr]
                self.flush()
            else:
                # A landing met an expectation: its client's callbacks are queued on
                # this loop; the ACKs go after them (a turn later, together).
                core.acks_later = False  # type: ignore[union-attr]
                self.loop.call_soon(self.flush)
        if not self._outbound:
            reading = core.reading  # type: ignore[union-attr]
            if reading != self._reading:
                self._reading = reading
                if reading:
                    if self._watched:
                        self._unwatch()
                    self.loop.add_reader(self._fd, self._readable)
                    self.loop.call_soon(self._readable)  # what came while it was held
                else:
                    self.loop.remove_reader(self._fd)
                    if self._hangups is not None and core.staging:  # type: ignore[union-attr]
                        self._watched = self._hangups.watch(self)
        if self._timer is not None and core.authenticated:
            self._timer.cancel()
            self._timer = None

    def flush(self) -> None:
        """Send what the core's output holds, as far as the socket takes it now."""
        core, sock = self.core, self.sock
        out = core.out
        while out.queued and not self.closed:
            views = out.views()
            try:
                n = sock.send(views[0]) if len(views) == 1 else sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.close(PeerUnreachable(f"{self._what()} broken: {exc}"))
                return
            core.sent(n)
            if core.events or (self._outbound and core.completions):  # type: ignore[union-attr]
                self._after()
        want = bool(out.queued) and not self.closed
        if want and not self._writing:
            self.loop.add_writer(self._fd, self.flush)
            self._writing = True
        elif not want and self._writing:
            self.loop.remove_writer(self._fd)
            self._writing = False
        if not self._outbound and not self.closed:
            reading = core.reading  # type: ignore[union-attr]
            if reading and not self._reading:
                self._reading = True
                if self._watched:
                    self._unwatch()
                self.loop.add_reader(self._fd, self._readable)
                self.loop.call_soon(self._readable)

    @property
    def queued(self) -> int:
        return self.core.out.queued

    # -- the end ------------------------------------------------------------------------

    def close(self, error: TransferdError | None = None, *, reset: bool = False) -> None:
        """End the link: the core closes (its parts fail), the socket goes; with
        ``reset``, what the kernel still holds to send goes with it (a cut, not a
        goodbye)."""
        if self.closed:
            return
        # (The core's close comes back through _after as its Closed event.)
        self.reset_on_cut = self.reset_on_cut or reset
        self.core.close(error)
        self._after()
        self._closed(error)

    def _closed(self, error: TransferdError | None) -> None:
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        out = self.core.out
        if out.queued and not self._outbound:
            # A refusal's reason (or the last ACKs): once, if the socket takes it.
            with contextlib.suppress(OSError):
                self.sock.send(b"".join(bytes(v) for v in out.take()))
        with contextlib.suppress(ValueError, OSError):
            if self._reading:
                self.loop.remove_reader(self._fd)
            if self._writing:
                self.loop.remove_writer(self._fd)
        self._reading = self._writing = False
        if self._watched:
            self._unwatch()
        if self.reset_on_cut or (self.reset_on_close and type(error) is PeerUnreachable):
            # Its parts may be re-sent on another rail: none of this link's bytes
            # may arrive after them.
            abort(self.sock)
        with contextlib.suppress(OSError):
            self.sock.close()
        self._handshake_outcome()
        self.owner.link_closed(self, error)

    def _unwatch(self) -> None:
        self._watched = False
        assert self._hangups is not None
        self._hangups.unwatch(self)

    def _handshake_outcome(self) -> None:
        """A handshake that failed is counted (and, receiving, logged) where it failed;
        a dialling daemon that hung up after our proof is counted too (authlog)."""
        core = self.core
        if core.authenticated:
            return
        rail = core.hs.rail
        if core.handshake_failed:
            # Dialling, the broken link's own WARNING (its parts' error) names it.
            authlog.peer_failed(core.hs, self.source, rail, emit=not self._outbound)
        elif self._peer_gone and not self._outbound:
            authlog.peer_hung_up(core.hs, self.source, rail)

    def _what(self) -> str:
        return "peer link"

    def peername(self) -> Any:
        try:
            return self.sock.getpeername()
        except OSError:
            return None
