"""One connection to a daemon: asyncio feeds the sans-IO ClientConnection, writes its frames.

The protocol of the connection (HELLO and AUTH with the server's proof checked, the
seq of every request and what it registered, which frame answers which, EVENT frames,
a one-way command's failure, the limits, CLOSING) is
:class:`transferd.protocol.connection.ClientConnection`.  This layer gives each request
a future (and a timer when it has a timeout), writes the frames the connection queues
through the transport kind's :class:`~transferd.transports.carriers.Carrier`, and turns
the connection's events into results: an :class:`Answer` resolves its future, a
:class:`Notice` goes to ``on_event`` (or, a one-way failure, to ``failed``), and a lost
connection fails every outstanding request with ConnectionLost (so nothing waits forever
on a dead server).  Replies with a payload are read straight into memory the caller
supplied (``sink``) when there is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from transferd import transports
from transferd.parts import MAX_MESSAGE
from transferd.protocol.connection import (
    Answer,
    ClientConnection,
    Notice,
    Outgoing,
    Ready,
    Refused,
)
from transferd.protocol.constants import Command, Flag, command_name
from transferd.protocol.errors import (
    BadFrame,
    BadRequest,
    ConnectionLost,
    PeerUnreachable,
    ProtocolError,
    Timeout,
    TransferdError,
)
from transferd.protocol.frames import Frame, Phase, Sink
from transferd.transports import TransportKind
from transferd.transports.carriers import Carrier, FdChannel

# The most one-way failures kept between two flush points: a server that sends error
# frames for requests never made (or one that fails thousands at once) costs a count past
# it, not a list that grows with what it sends.  A fatal one is always kept.
MAX_FAILURES = 1024

# How long close() waits for the server to finish what this connection sent
# and close its side, before closing outright.
CLOSE_LINGER = 5.0

_NAMES: dict[int, str] = {int(c): c.name for c in Command}
# In Python 3.11 ``Flag.X`` goes through EnumType.__getattr__: alias it once.
_NO_REPLY = int(Flag.NO_REPLY)
_ANSWER = Answer
_NOTICE = Notice
_BROKEN = Phase.BROKEN
_HEADER = Phase.HEADER


@dataclass(slots=True)
class Pending:
    """A request waiting for its reply: what the ClientConnection hands back in its Answer."""

    cmd: int
    future: asyncio.Future[Frame]
    sink: Sink | Callable[[Frame], Sink] = None
    timer: asyncio.TimerHandle | None = None


class ClientStats:
    """Client-side counts per command sent, and bytes each way."""

    def __init__(self) -> None:
        self.commands: dict[str, int] = {}
        self.bytes_out = 0
        self.bytes_in = 0

    def snapshot(self) -> dict[str, Any]:
        return {
            "commands": dict(self.commands),
            "bytes_out": self.bytes_out,
            "bytes_in": self.bytes_in,
        }

    def line(self) -> str:
        cmds = " ".join(f"{k}={v}" for k, v in sorted(self.commands.items()))
        return f"transferd-client stats: {cmds} bytes_out={self.bytes_out} bytes_in={self.bytes_in}"


class Connection(asyncio.BufferedProtocol):
    def __init__(self, kind: TransportKind | None = None) -> None:
        self.kind = kind
        self.transport: asyncio.Transport | None = None
        self.carrier: Carrier | None = None
        # The carrier's descriptor channel (unix, seqpacket): kept past the loss, for the
        # descriptors of a reply that came just before it.
        self._fds: FdChannel | None = None
        self.stats = ClientStats()
        self._closed: asyncio.Future[None] | None = None
        self._ready: asyncio.Future[Ready] | None = None
        # Failures of NO_REPLY commands, raised at the next flush point.
        self.failed: list[TransferdError] = []
        # How many more there were, past MAX_FAILURES (reported with the first).
        self.failures_dropped = 0
        # Unasked EVENT frames (engine completions, messages) go here.
        # Returns True when it consumed the event (an engine completion).
        self.on_event: Callable[[Frame], bool] | None = None
        self.on_lost: Callable[[TransferdError], None] | None = None
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._paused = False
        # close() half-closed the transport (write_eof): nothing more can be sent (the
        # transport would raise RuntimeError, a request's token left pending).
        self._eof = False
        # The transport's loop (connection_made): requests make their futures on it
        # without asking asyncio for the running loop (a getpid system call) each time.
        self._loop: asyncio.AbstractEventLoop | None = None
        # The URL it was opened with, and whether that transport keeps bytes private.
        self.url = ""
        self.private = False
        self.machine = ClientConnection(max_collect=MAX_MESSAGE)
        self.decoder = self.machine.decoder
        # The transport asks the decoder directly: one Python call less per read.
        self.get_buffer = self.decoder.get_buffer  # type: ignore[method-assign]

    @property
    def lost(self) -> TransferdError | None:
        return self.machine.lost

    @property
    def pending(self) -> dict[int, Any]:
        return self.machine.pending

    @property
    def max_body(self) -> int:
        return self.machine.max_body

    @max_body.setter
    def max_body(self, value: int) -> None:
        self.machine.max_body = value

    @property
    def max_payload(self) -> int:
        return self.machine.max_payload

    @max_payload.setter
    def max_payload(self, value: int) -> None:
        self.machine.max_payload = value

    @classmethod
    async def open(
        cls,
        url: str,
        timeout: float | None = 10.0,
        options: transports.TransportOptions | None = None,
    ) -> Connection:
        """Connect by URL (any scheme of :mod:`transferd.transports`)."""
        opts = options or transports.TransportOptions()
        opts.timeout = timeout
        kind = transports.get(url)
        try:
            _, conn = await transports.connect(url, functools.partial(cls, kind), opts)
        except (TimeoutError, OSError) as exc:
            raise PeerUnreachable(f"cannot connect to {url}: {str(exc) or 'timed out'}") from None
        c = cast(Connection, conn)
        c.url = url
        c.private = kind.private
        return c

    async def handshake(self, *, name: str, max_minor: int, secret: bytes | None,
                        method: str, timeout: float | None) -> dict[str, Any]:
        """HELLO (and AUTH) through the sans-IO ClientConnection: the server's HELLO reply.

        A server that does not prove it knows ``secret`` is refused (Unauthorized naming
        this connection's URL) and the connection closed, before any request goes to it.
        """
        try:
            # The machine (and its decoder, whose buffers the transport already has) was
            # made with the connection; now it learns who it is.
            m = self.machine
            m.prepare(name=name, max_minor=max_minor, secret=secret, method=method,
                      address=self.url, private=self.private)
            self._ready = asyncio.get_running_loop().create_future()
            m.start()
            self._flush()
            try:
                ready = await asyncio.wait_for(asyncio.shield(self._ready), timeout)
            except TimeoutError:
                raise Timeout(f"HELLO got no reply in {timeout:g} s", seq=1) from None
            body = ready.hello
            if "max_message" in body:  # (judged here: a refusal closes, as any above)
                self.set_max_message(int(body["max_message"]))
        except TransferdError:
            # Nothing a failed handshake sent needs the server's answer: closed at once
            # (close()'s linger waited 5 s more for a server that may never close,
            # past connect_timeout), and its future, which the close fails, is taken.
            ready_fut = self._ready
            if ready_fut is not None and not ready_fut.done():
                ready_fut.cancel()
            await self.close(linger=0)
            raise
        return body

    def set_max_message(self, max_message: int) -> None:
        """The server's ``max_message`` (HELLO reply): payload continuation size."""
        if not transports.MIN_MAX_MESSAGE <= max_message <= 64 << 20:
            raise BadFrame(f"server announced max_message {max_message}, outside 64 KiB-64 MiB")
        if self.carrier is not None:
            self.carrier.set_message_limits(max_message, max_message)

    @property
    def carries_fds(self) -> bool:
        """True on unix:// and seqpacket:// connections (SCM_RIGHTS both ways)."""
        return self._fds is not None

    def take_fds(self, n: int) -> list[int]:
        """The ``n`` oldest file descriptors received (the caller closes them).

        The server sends descriptors with the first byte of a frame, so when
        that frame is handled here they have arrived; a frame that announces
        ``n`` of them takes them with this.  BadFrame if fewer came.
        """
        if self._fds is None:
            raise BadRequest("file descriptors travel only over unix:// and seqpacket://")
        return self._fds.take(n)

    # -- asyncio callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but are one.
        self.transport = cast(asyncio.Transport, transport)
        self._loop = asyncio.get_running_loop()
        self._closed = self._loop.create_future()
        kind = self.kind or transports.get("tcp://")
        self.carrier = kind.carrier(transport, server=False, join_counter="client.send_join")
        self._fds = self.carrier.fds

    def transport_error(self, exc: ProtocolError) -> None:
        """A message transport found a message that breaks the message rules."""
        self._fail_all(exc)
        if self.transport is not None:
            self.transport.close()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.machine.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        m = self.machine
        d = m.decoder
        if d._direct:
            d.buffer_updated(nbytes)
        else:
            d._end += nbytes  # FrameDecoder.buffer_updated, the usual case inlined
        self.stats.bytes_in += nbytes
        ev: Any
        while True:
            ev = m.next_event()
            if ev is None:
                break
            if type(ev) is _ANSWER:  # the usual event: resolve its request (inlined)
                p = ev.token
                if p.timer is not None:
                    p.timer.cancel()
                fut = p.future
                if not fut.done():
                    if ev.error is None:
                        fut.set_result(ev.frame)
                    else:
                        fut.set_exception(ev.error)
                if d._start == d._end and d.phase is _HEADER:
                    break  # next_event's "nothing buffered", without the call
            elif type(ev) is _NOTICE:
                if self.on_event is not None and self.on_event(ev.frame):
                    continue
                if ev.error is not None:
                    self.note_failure(ev.error)
            elif type(ev) is Ready:
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(ev)
            else:
                self._refused(ev)
                if m.decoder.phase is _BROKEN:
                    return
        if m.out:
            self._flush()  # the handshake's AUTH

    def _refused(self, ev: Refused) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ev.error)  # the handshake failed
            return
        if self.machine.decoder.phase is _BROKEN:
            # The stream broke the framing rules: nothing more can be read.
            self._fail_all(ev.error)
            if self.transport is not None:
                self.transport.close()
            return
        # A fatal error before any request, or for a seq we gave up on.
        self.note_failure(ev.error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(ConnectionLost(f"connection closed{': ' + str(exc) if exc else ''}"))
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ConnectionLost(
                f"{self.url or 'the server'}: the connection closed during the handshake"))
        self._wake_drain()
        if self.carrier is not None:
            self.carrier.close()
        # Nothing comes in again: let go of what named this connection's owner back (the
        # Client's methods), of the decoder's sink (a method of the machine that holds
        # the decoder), and of the transport and its carrier (a TLS transport, asyncio's
        # or uvloop's, keeps this connection's buffer_updated after the loss). Each was a
        # reference cycle only the cyclic collector frees. (What is sent from now on is
        # ConnectionLost, as it was: every write checks for a transport.)
        self.on_event = self.on_lost = None
        self.machine.detach()
        t: Any = self.transport
        if getattr(t, "_read_ready_cb", None) is not None:
            # Python 3.11's asyncio socket transport keeps a bound method of itself for
            # its reads after the loss (a cycle of 7 objects a connection); 3.12 drops it
            # at close (python/cpython#100348), and so does this, once nothing is read.
            t._read_ready_cb = None
        self.transport = None
        self.carrier = None

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self.carrier is not None:
            self.carrier.drained()
        self._wake_drain()

    def _wake_drain(self) -> None:
        for w in self._drain_waiters:
            if not w.done():
                w.set_result(None)
        self._drain_waiters.clear()

    def _fail_all(self, exc: TransferdError) -> None:
        if self.on_lost is not None and self.machine.lost is None:
            self.on_lost(exc)
        tokens = self.machine.lose(exc)
        # A fatal error reply may have arrived just before the close: prefer it.
        for f in self.failed:
            if f.fatal:
                exc = f
                break
        for p in tokens:
            if p.timer is not None:
                p.timer.cancel()
            if not p.future.done():
                p.future.set_exception(type(exc)(exc.message, seq=exc.seq))

    # -- outgoing ---------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        """The seq of the frame sent last (what a reply or event will carry)."""
        return self.machine.last_seq

    def _flush(self) -> None:
        """Write the frames the connection queued itself (HELLO, AUTH)."""
        m = self.machine
        out, m.out = m.out, []
        for o in out:
            self._write(o)

    def _write(self, o: Outgoing) -> None:
        carrier, t = self.carrier, self.transport
        if carrier is None or t is None or t.is_closing() or self._eof:
            raise ConnectionLost(self.lost.message if self.lost else "connection is closed")
        if o.fds:
            assert carrier.fds is not None  # send() refuses descriptors elsewhere
            carrier.fds.send(o.fds)
        carrier.write(o.head, o.payload, o.payload_len)
        stats = self.stats
        stats.bytes_out += len(o.head) + o.payload_len
        cmd = o.head[2]  # the header's cmd byte
        name = _NAMES.get(cmd) or command_name(cmd)
        cmds = stats.commands
        cmds[name] = cmds.get(name, 0) + 1

    def send(
        self,
        cmd: int,
        body: dict[str, Any] | None = None,
        payload: Sequence[Any] = (),
        *,
        flags: int = 0,
        fds: Sequence[int] = (),
    ) -> int:
        """Write one request frame without waiting for a reply; its seq.  Payload objects
        are sent from where they lie; ``fds`` (unix and seqpacket only) go with the
        frame's first byte."""
        if fds and not self.carries_fds:
            raise BadRequest("file descriptors travel only over unix:// and seqpacket://")
        return self._send(cmd, body, payload, int(flags), fds, None)

    def request(
        self,
        cmd: int,
        body: dict[str, Any] | bytes | None = None,
        payload: Sequence[Any] = (),
        *,
        sink: Sink | Callable[[Frame], Sink] = None,
        timeout: float | None = None,
    ) -> asyncio.Future[Frame]:
        """Send a request; the future resolves with its reply frame or raises."""
        loop = self._loop or asyncio.get_running_loop()
        fut: asyncio.Future[Frame] = loop.create_future()
        p = Pending(cmd, fut, sink)
        seq = self._send(cmd, body, payload, 0, (), p)
        if timeout is not None:
            p.timer = loop.call_later(timeout, self._time_out, seq, timeout)
        return fut

    def send_views(self, cmd: int, body: dict[str, Any] | bytes | None, views: Sequence[Any],
                   payload_len: int | None = None, *, oneway: bool = False) -> int:
        """:meth:`send` of a payload that is already bytes or byte views (the queue's
        columns), of ``payload_len`` bytes when the caller knows it: no pass over it."""
        return self._send(cmd, body, views, _NO_REPLY if oneway else 0, (), None,
                          ready=True, payload_len=payload_len)

    def _send(self, cmd: int, body: dict[str, Any] | bytes | None, payload: Sequence[Any],
              flags: int, fds: Sequence[int], token: Pending | None, *,
              ready: bool = False, payload_len: int | None = None) -> int:
        """Make the request (ClientConnection.request) and write it; its seq."""
        carrier, t = self.carrier, self.transport
        if carrier is None or t is None or t.is_closing() or self._eof:
            raise ConnectionLost(self.lost.message if self.lost else "connection is closed")
        views: Sequence[Any]
        if not payload:
            views, plen = (), 0
        elif ready:
            views = payload
            plen = sum(map(len, views)) if payload_len is None else payload_len
        else:
            views = [p if type(p) is bytes else memoryview(p).cast("B") for p in payload]
            plen = sum(map(len, views))
        m = self.machine
        o = m.request(cmd, body, views, flags=flags, fds=fds, token=token, payload_len=plen)
        if fds:
            assert carrier.fds is not None  # send() checked
            carrier.fds.send(fds)
        carrier.write(o.head, views, plen)
        stats = self.stats
        stats.bytes_out += len(o.head) + plen
        name = _NAMES.get(cmd) or command_name(cmd)
        cmds = stats.commands
        cmds[name] = cmds.get(name, 0) + 1
        return m._seq

    def send_oneway(
        self, cmd: int, body: dict[str, Any] | None, payload: Sequence[Any] = ()
    ) -> int:
        return self.send(cmd, body, payload, flags=_NO_REPLY)

    def _time_out(self, seq: int, timeout: float) -> None:
        p = self.machine.forget(seq)
        if p is not None and not p.future.done():
            p.future.set_exception(
                Timeout(f"{command_name(p.cmd)} got no reply in {timeout:g} s", seq=seq)
            )

    async def drain(self) -> None:
        """Wait until the transport's write buffer is under its high-water mark."""
        if self._paused and self.lost is None:
            w = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(w)
            await w

    def note_failure(self, exc: TransferdError) -> None:
        """A one-way command failed: raised at the next flush point (at most MAX_FAILURES
        kept; past them only counted, but a fatal one is kept if none is yet)."""
        failed = self.failed
        if len(failed) < MAX_FAILURES or (exc.fatal and not any(f.fatal for f in failed)):
            failed.append(exc)
        else:
            self.failures_dropped += 1

    def take_failures(self) -> list[TransferdError]:
        failed, self.failed = self.failed, []
        return failed

    def take_dropped(self) -> int:
        """How many failures past MAX_FAILURES were counted since the last call."""
        n, self.failures_dropped = self.failures_dropped, 0
        return n

    async def close(self, linger: float = CLOSE_LINGER) -> None:
        t = self.transport
        if t is not None and not t.is_closing():
            if self.lost is None and self._closed is not None and t.can_write_eof():
                # Half-close, then read until the server closes: it runs every
                # frame we sent first.  Closing outright could make our socket
                # answer its replies with a reset that discards frames it has
                # not read yet.
                self._eof = True
                t.write_eof()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._closed), linger)
            if not t.is_closing():
                t.close()
        if self._closed is not None:
            await asyncio.shield(self._closed)
