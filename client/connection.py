"""One connection to a daemon: framing, the pending-request table, events.

Every request gets a future keyed by its seq; the reply resolves it, a
connection loss fails every outstanding one with ConnectionLost (so nothing
waits forever on a dead server).  Replies with a payload are read straight
into memory the caller supplied (``sink``) when there is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from transferd import transports
from transferd.copies import COUNTING, count
from transferd.parts import MAX_MESSAGE
from transferd.protocol import frames
from transferd.protocol.connection import ClientConnection
from transferd.protocol.constants import (
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_PAYLOAD,
    HEADER_SIZE,
    HELLO_MAX_BODY,
    MAGIC,
    Command,
    Flag,
    command_name,
)
from transferd.protocol.errors import (
    BadFrame,
    BadRequest,
    ConnectionLost,
    OverLimit,
    ProtocolError,
    Timeout,
    TransferdError,
    error_from_body,
)
from transferd.protocol.frames import Frame, FrameDecoder, Sink

# Replies whose payload the client asked for (the size it asked); any other payload (an
# event's message, a reply to anything else) is collected only up to a message's size.
_GETS = (int(Command.GET_TENSOR), int(Command.GET_TENSORS))


def _collected(frame: Frame) -> Sink:
    """A payload nobody set memory up for: the decoder collects it into a bytearray of
    the size the server announced, so a size over a message's is refused, not allocated
    (a lying server's EVENT announcing 16 GiB would have had 16 GiB zeroed)."""
    if frame.payload_len > MAX_MESSAGE:
        raise BadFrame(f"a payload of {frame.payload_len} bytes on a "
                       f"{command_name(frame.cmd)} frame nothing asked for (at most "
                       f"{MAX_MESSAGE})", seq=frame.seq)
    return None


# Joining a small payload with its header saves a syscall; big ones go as is.
SMALL_WRITE = 16 * 1024
# How long close() waits for the server to finish what this connection sent
# and close its side, before closing outright.
CLOSE_LINGER = 5.0

_NAMES: dict[int, str] = {int(c): c.name for c in Command}
# In Python 3.11 ``Flag.X`` goes through EnumType.__getattr__: alias it once.
_NO_REPLY = int(Flag.NO_REPLY)
_REPLY = int(Flag.REPLY)
_ERROR = int(Flag.ERROR)
_EVENT = int(Flag.EVENT)
_REPLY_ERROR = int(Flag.REPLY | Flag.ERROR)
_pack_header = frames.HEADER.pack


@dataclass(slots=True)
class Pending:
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
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder(max_body=HELLO_MAX_BODY, payload_sink=self._sink_for)
        # The transport asks the decoder directly: one Python call less per read.
        self.get_buffer = self.decoder.get_buffer  # type: ignore[method-assign]
        self.pending: dict[int, Pending] = {}
        self.stats = ClientStats()
        self._seq = 0
        self._closed: asyncio.Future[None] | None = None
        self.lost: TransferdError | None = None
        # Failures of NO_REPLY commands, raised at the next flush point.
        self.failed: list[TransferdError] = []
        # Unasked EVENT frames (engine completions, messages) go here.
        # Returns True when it consumed the event (an engine completion).
        self.on_event: Callable[[Frame], bool] | None = None
        self.on_lost: Callable[[TransferdError], None] | None = None
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._paused = False
        # A message transport takes whole frames (None: a stream, write bytes).
        self._write_frame: Any = None
        # The URL it was opened with, and whether that transport keeps bytes private.
        self.url = ""
        self.private = False
        # The server's limits (HELLO reply): no frame over them is sent, so a TOO_LARGE
        # that comes back once READY is a per-request cap (OverLimit), never a frame's.
        self.max_body = 1 << 62
        self.max_payload = 1 << 62
        # None until READY: an error during the handshake is what its code says (fatal
        # where the code has a fatal class); False after (see max_body).
        self._errors_fatal: bool | None = None

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
        try:
            _, conn = await transports.connect(url, cls, opts)
        except (TimeoutError, OSError) as exc:
            from transferd.protocol.errors import PeerUnreachable

            raise PeerUnreachable(f"cannot connect to {url}: {exc or 'timed out'}") from None
        c = cast(Connection, conn)
        c.url = url
        c.private = transports.get(url).private
        return c

    async def handshake(self, *, name: str, max_minor: int, secret: bytes | None,
                        method: str, timeout: float | None) -> dict[str, Any]:
        """HELLO (and AUTH) through the sans-IO ClientConnection: the server's HELLO reply.

        A server that does not prove it knows ``secret`` is refused (Unauthorized naming
        this connection's URL) and the connection closed, before any request goes to it.
        """
        try:
            hs = ClientConnection(name=name, max_minor=max_minor, secret=secret,
                                  method=method, address=self.url, private=self.private)
            reply = await self.request(Command.HELLO, hs.hello_body(), timeout=timeout)
            mac = hs.hello_reply(reply.body)
            if mac is not None:
                await self.request(Command.AUTH, mac, timeout=timeout)
                hs.auth_reply()
        except TransferdError:
            await self.close()
            raise
        b = reply.body
        self.max_body = int(b.get("max_body", DEFAULT_MAX_BODY))
        self.max_payload = int(b.get("max_payload", DEFAULT_MAX_PAYLOAD))
        self._errors_fatal = False
        return b

    def set_max_message(self, max_message: int) -> None:
        """The server's ``max_message`` (HELLO reply): payload continuation size."""
        if not transports.MIN_MAX_MESSAGE <= max_message <= 64 << 20:
            raise BadFrame(f"server announced max_message {max_message}, outside 64 KiB-64 MiB")
        t: Any = self.transport
        if self._write_frame is not None and t is not None:
            t.max_message = max_message
            t.recv_limit = max_message

    @property
    def carries_fds(self) -> bool:
        """True on unix:// and seqpacket:// connections (SCM_RIGHTS both ways)."""
        return bool(self.transport is not None and self.transport.get_extra_info("transferd_fds"))

    def take_fds(self, n: int) -> list[int]:
        """The ``n`` oldest file descriptors received (the caller closes them).

        The server sends descriptors with the first byte of a frame, so when
        that frame is handled here they have arrived; a frame that announces
        ``n`` of them takes them with this.  BadFrame if fewer came.
        """
        take = getattr(self.transport, "take_fds", None)
        if take is None:
            raise BadRequest("file descriptors travel only over unix:// and seqpacket://")
        return cast(list[int], take(n))

    # -- asyncio callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but are one.
        self.transport = cast(asyncio.Transport, transport)
        self._closed = asyncio.get_running_loop().create_future()
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if transport.get_extra_info("transferd_message"):
            self._write_frame = self.transport.write_frame  # type: ignore[attr-defined]

    def transport_error(self, exc: ProtocolError) -> None:
        """A message transport found a message that breaks the message rules."""
        self._fail_all(exc)
        if self.transport is not None:
            self.transport.close()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.decoder.buffer_updated(nbytes)
        self.stats.bytes_in += nbytes
        while True:
            try:
                frame = self.decoder.next_frame()
            except ProtocolError as exc:
                self._fail_all(exc)
                if self.transport is not None:
                    self.transport.close()
                return
            if frame is None:
                return
            self._dispatch(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(ConnectionLost(f"connection closed{': ' + str(exc) if exc else ''}"))
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)
        self._wake_drain()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drain()

    def _wake_drain(self) -> None:
        for w in self._drain_waiters:
            if not w.done():
                w.set_result(None)
        self._drain_waiters.clear()

    # -- incoming ---------------------------------------------------------------------

    def _sink_for(self, frame: Frame) -> Sink:
        if (int(frame.flags) & _REPLY_ERROR) != _REPLY:  # not a plain reply
            return _collected(frame)
        p = self.pending.get(frame.seq)
        if p is None or (p.sink is None and p.cmd not in _GETS):
            return _collected(frame)
        # A callable sink picks the memory now that the reply is known good.
        return p.sink(frame) if callable(p.sink) else p.sink

    def _dispatch(self, frame: Frame) -> None:
        flags = int(frame.flags)
        if flags & _EVENT:
            if self.on_event is not None and self.on_event(frame):
                return
            if frame.is_error:  # a one-way command's failure: never fatal
                self.failed.append(error_from_body(frame.body, seq=frame.seq, fatal=False))
            return
        p = self.pending.pop(frame.seq, None)
        if p is None:
            if frame.is_error:
                # A fatal error before any request (or for a seq we gave up on).
                self.failed.append(error_from_body(frame.body, seq=frame.seq))
            return
        if p.timer is not None:
            p.timer.cancel()
        if p.future.done():
            return
        if flags & _ERROR:
            p.future.set_exception(error_from_body(frame.body, seq=frame.seq,
                                                   fatal=self._errors_fatal))
        else:
            p.future.set_result(frame)

    def _fail_all(self, exc: TransferdError) -> None:
        if self.lost is None:
            self.lost = exc
        if self.on_lost is not None:
            self.on_lost(exc)
        # A fatal error reply may have arrived just before the close: prefer it.
        for f in self.failed:
            if f.fatal:
                exc = f
                break
        pending, self.pending = self.pending, {}
        for p in pending.values():
            if p.timer is not None:
                p.timer.cancel()
            if not p.future.done():
                p.future.set_exception(type(exc)(exc.message, seq=exc.seq))

    # -- outgoing ---------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        """The seq of the frame sent last (what a reply or event will carry)."""
        return self._seq

    def send(
        self,
        cmd: int,
        body: dict[str, Any] | None = None,
        payload: Sequence[Any] = (),
        *,
        flags: int = 0,
        seq: int | None = None,
        fds: Sequence[int] = (),
    ) -> int:
        """Write one request frame; payload objects are sent from where they lie.

        ``fds`` (unix and seqpacket only) go with the frame's first byte.
        """
        if self.lost is not None or self.transport is None or self.transport.is_closing():
            raise ConnectionLost(self.lost.message if self.lost else "connection is closed")
        if seq is None:
            seq = self._seq = (self._seq + 1) & 0xFFFFFFFF or 1
        raw = frames.pack_body(body) if body else b""
        if payload:
            views = [p if type(p) is bytes else memoryview(p).cast("B") for p in payload]
            plen = sum(map(len, views))
        else:
            views, plen = [], 0
        if len(raw) > self.max_body or plen > self.max_payload:
            # Refused here, not by the server (which would close the connection).
            raise OverLimit(
                f"a {command_name(cmd)} of {len(raw)} bytes of body and {plen} of payload is "
                f"over the server's max_body {self.max_body} / max_payload "
                f"{self.max_payload} (announced in HELLO): split it")
        # encode_header(), inlined: this runs once per request.
        head = _pack_header(MAGIC, cmd, int(flags), seq & 0xFFFFFFFF, len(raw), 0, plen) + raw
        if fds:
            send_fds = getattr(self.transport, "send_fds", None)
            if send_fds is None:
                raise BadRequest("file descriptors travel only over unix:// and seqpacket://")
            send_fds(fds)
        if self._write_frame is not None:
            self._write_frame(head, views, plen)
        elif plen <= SMALL_WRITE:
            if COUNTING and plen:
                count("client.send_join", plen)
            self.transport.write(b"".join((head, *views)) if plen else head)
        else:
            # One call for all payload objects: sent together, not a syscall each.
            self.transport.writelines((head, *views))
        name = _NAMES.get(cmd) or command_name(cmd)
        self.stats.commands[name] = self.stats.commands.get(name, 0) + 1
        self.stats.bytes_out += HEADER_SIZE + len(raw) + plen
        return seq

    def request(
        self,
        cmd: int,
        body: dict[str, Any] | None = None,
        payload: Sequence[Any] = (),
        *,
        sink: Sink | Callable[[Frame], Sink] = None,
        timeout: float | None = None,
    ) -> asyncio.Future[Frame]:
        """Send a request; the future resolves with its reply frame or raises."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Frame] = loop.create_future()
        seq = self.send(cmd, body, payload)
        p = Pending(cmd, fut, sink)
        if timeout is not None:
            p.timer = loop.call_later(timeout, self._time_out, seq, timeout)
        self.pending[seq] = p
        return fut

    def send_oneway(
        self, cmd: int, body: dict[str, Any] | None, payload: Sequence[Any] = ()
    ) -> int:
        return self.send(cmd, body, payload, flags=_NO_REPLY)

    def _time_out(self, seq: int, timeout: float) -> None:
        p = self.pending.pop(seq, None)
        if p is not None and not p.future.done():
            p.future.set_exception(
                Timeout(f"{Command(p.cmd).name} got no reply in {timeout:g} s", seq=seq)
            )

    async def drain(self) -> None:
        """Wait until the transport's write buffer is under its high-water mark."""
        if self._paused and self.lost is None:
            w = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(w)
            await w

    def take_failures(self) -> list[TransferdError]:
        failed, self.failed = self.failed, []
        return failed

    async def close(self, linger: float = CLOSE_LINGER) -> None:
        t = self.transport
        if t is not None and not t.is_closing():
            if self.lost is None and self._closed is not None and t.can_write_eof():
                # Half-close, then read until the server closes: it runs every
                # frame we sent first.  Closing outright could make our socket
                # answer its replies with a reset that discards frames it has
                # not read yet.
                t.write_eof()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._closed), linger)
            if not t.is_closing():
                t.close()
        if self._closed is not None:
            await asyncio.shield(self._closed)
