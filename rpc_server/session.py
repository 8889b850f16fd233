"""One client connection: feeds the sans-IO decoder, runs commands in order.

Bytes go from the socket straight to where the decoder says (a SET's target
tensor, via ``get_buffer``).  Frames are executed one at a time, in arrival
order; a command whose handler is asynchronous (SYNCHRONIZE waiting for
transfers) holds the next frames back until it has finished.

Reads pause whenever replies are waiting in the transport (write-buffer
limits of zero): GET payloads are sent from the buffer where they lie, so no
later SET on this connection may land in that memory until the bytes are out.
The same pause is the connection's back-pressure.

The handshake (HELLO, AUTH, the pre-auth limits, the handshake timeout) is the
sans-IO :class:`transferd.protocol.connection.ServerConnection`; this layer
feeds it the frames that arrive before READY, writes what it produces, and
runs the clock (a timer at its deadline).  Once READY, frames go straight from
the decoder to the command handlers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from transferd.copies import COUNTING, count
from transferd.logs import hostport, log_client_error
from transferd.memory import Ref, release_all
from transferd.preauth import Ticket, Why
from transferd.protocol import frames
from transferd.protocol.auth import TOKEN
from transferd.protocol.connection import (
    ConnState,
    Ready,
    Refused,
    ServerConnection,
    ServerSettings,
    failure_frame,
)
from transferd.protocol.constants import (
    COMMAND_MINOR,
    HEADER_SIZE,
    MAGIC,
    PROTO_MAJOR,
    Command,
    Flag,
)
from transferd.protocol.errors import (
    BadRequest,
    Cancelled,
    Internal,
    NoHello,
    ProtocolError,
    Timeout,
    TransferdError,
    UnknownCommand,
)
from transferd.protocol.frames import DISCARD, Frame, Sink

from .context import ServerContext
from .handlers import HANDLERS, Reply, payload_sink, session_closed
from .tls_output import ChunkedOutput

log = logging.getLogger("transferd.session")

# Replies with at most this many payload bytes are joined with their header
# into one write: one syscall instead of two costs a small copy.
SMALL_REPLY = 16 * 1024

# Frames one connection runs in one turn of the loop before yielding to the
# others (a handler's own work is bounded separately: large clears and copies
# go in slices).
PUMP_FRAMES = 64

# Hot-path lookups: calling an IntEnum or combining IntFlags runs Python code.
_COMMANDS: dict[int, Command] = {int(c): c for c in Command}
_NOT_REQUEST_FLAGS = int(Flag.REPLY | Flag.ERROR | Flag.EVENT)


# The session's states are the connection's (HELLO, AUTH, READY, CLOSING,
# CLOSED); the name State stays for callers that knew it.
State = ConnState

# Module-level aliases for the per-frame path: in Python 3.11 ``State.X`` and
# ``Flag.X`` go through EnumType.__getattr__, ten times slower than a global.
_AWAIT_HELLO = ConnState.HELLO
_AWAIT_AUTH = ConnState.AUTH
_CLOSED = ConnState.CLOSED
_CLOSING = ConnState.CLOSING
_AUTH = Command.AUTH
_REPLY = int(Flag.REPLY)
_NO_REPLY = int(Flag.NO_REPLY)
_READY = ConnState.READY
_pack_header = frames.HEADER.pack


def _identity(transport: asyncio.BaseTransport) -> tuple[str, str]:
    """(source, label): who a connection is counted as before it authenticates, and how
    logs name it.  TCP and TLS: the peer's IP; a Unix socket: the peer's uid
    (SO_PEERCRED), so one local user cannot take another's handshake slots."""
    peer = transport.get_extra_info("peername")
    cred = transport.get_extra_info("peercred")
    if cred is not None:
        pid, uid, _gid = cred
        return f"uid {uid}", f"local (pid {pid}, uid {uid})"
    if isinstance(peer, tuple) and peer:
        return str(peer[0]), hostport(peer)
    return "local", "local"


def _stopping() -> Cancelled:
    return Cancelled("the daemon is stopping (SIGTERM, draining): request refused, "
                     "nothing done; retry on another daemon or after the restart")


class Session(asyncio.BufferedProtocol):
    def __init__(self, ctx: ServerContext, settings: ServerSettings | None = None) -> None:
        self.ctx = ctx
        self.state = ConnState.HELLO
        self.peer = "?"
        self.source = "?"
        self.client_name = ""
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self.conn = ServerConnection(
            settings or ctx.settings_for("tcp"), self._loop.time(), payload_sink=self._sink_for
        )
        self._decoder = self.conn.decoder
        # The pre-auth slot (transferd/preauth.py) until the handshake ends.
        self._ticket: Ticket | None = None
        # The handshake frame being answered (cmd, seq): a held verdict's answer names it.
        self._hs_frame = (int(Command.HELLO), 0)
        self._timer: asyncio.TimerHandle | None = None
        # The transport asks the decoder directly: one Python call less per read.
        self.get_buffer = self._decoder.get_buffer  # type: ignore[method-assign]
        self._sink_error: TransferdError | None = None
        self._blockers = 0
        # The client half-closed: run what it sent, then close.
        self._eof = False
        # Engine operations this connection submitted and that have not
        # finished; SYNCHRONIZE waits for them.
        self.pending: set[asyncio.Future[Any]] = set()
        # Per-connection engine state (receive pools, watchers) hangs here.
        self.engine_state: Any = None
        self._tasks: set[asyncio.Future[None]] = set()
        # Holds on the memory of reply payloads still in the transport's
        # write buffer: released once it has drained, or the connection is gone.
        self._held: list[Ref] = []
        # A message transport takes whole frames (None: a stream, write bytes).
        self._write_frame: Any = None
        self._write_blocked = False
        # TLS: replies go to the SSL layer a chunk at a time (tls_output.py); reads
        # stay paused while any of them waits.
        self._tls_out: ChunkedOutput | None = None
        self._tls_blocked = False

    # -- asyncio callbacks --------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but are one.
        self.transport = cast(asyncio.Transport, transport)
        if transport.get_extra_info("sslcontext") is None:
            self.transport.set_write_buffer_limits(high=0, low=0)
        else:
            # TLS: the SSL layer encrypts what it is given at write time (a copy), so
            # replies go to it a chunk at a time (tls_output.py sets the limits; with a
            # zero high-water mark uvloop's SSL transport never reports the buffer
            # drained while reading is paused).
            self._tls_out = ChunkedOutput(self.transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if transport.get_extra_info("transferd_message"):
            self._write_frame = self.transport.write_frame  # type: ignore[attr-defined]
        self.source, self.peer = _identity(transport)
        self.ctx.metrics.connections.inc()
        self.ctx.metrics.connections_accepted.inc()
        admitted = self.ctx.admission.admit(self.source, self._loop.time(), self)
        self.ctx.gave_way(admitted.closed)
        if admitted.ticket is None:
            self.ctx.note_refused_connection(self.source, admitted.reason)
            self.state = _CLOSED
            self.transport.abort()
            return
        self._ticket = admitted.ticket
        self.ctx.sessions.add(self)
        self._timer = self._loop.call_at(self.conn.deadline, self._handshake_timeout)
        log.debug("connection from %s", self.peer)

    def give_way(self, why: Why) -> None:
        """The admission handed this connection's pre-auth slot to a newer one."""
        self._ticket = None
        if self.state is _CLOSED or self.state is _READY:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._answer_at_deadline(why.value)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = _CLOSED
        self.conn.connection_lost()
        self._end_handshake()
        self.ctx.metrics.connections.dec()
        self.ctx.sessions.discard(self)
        self._release_held()
        if self._tls_out is not None:
            self._tls_out.close()
        session_closed(self)  # buffers this connection owned (shared memory)
        if self.ctx.engine is not None:
            self.ctx.engine.session_closed(self)
        log.debug("connection from %s closed (%s)", self.peer, exc or "eof")

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._decoder.buffer_updated(nbytes)
        self.ctx.stats.bytes_in += nbytes
        self._pump()

    def eof_received(self) -> bool:
        # A half-close says "that is all I send", not "drop what I sent": the
        # frames already received still run, in order, and the connection
        # closes once the last of them has (the client keeps reading until then).
        if self.state is not _READY:
            return False
        self._eof = True
        self._loop.call_soon(self._pump)
        return True

    def pause_writing(self) -> None:
        # Before READY no reply holds memory the client could overwrite, and a
        # TLS transport pauses here while its handshake is buffered: blocking
        # reads then would stall the handshake that drains the buffer.
        if self.state is not _READY:
            return
        self._write_blocked = True
        self._block()

    def resume_writing(self) -> None:
        # The write buffer is empty (low watermark 0): every payload is out.
        self._release_held()
        if self._write_blocked:
            self._write_blocked = False
            self._unblock()
        # TLS: the next chunks (a write here may pause writing again, nested).
        if self._tls_blocked and self._tls_out is not None and not self._tls_out.pump():
            self._tls_blocked = False
            self._unblock()
        if self.ctx.engine is not None and not self.write_blocked:
            # Peer messages handed to this connection are out: their senders' ACKs.
            self.ctx.engine.session_drained(self)

    @property
    def write_blocked(self) -> bool:
        """Unsent bytes wait in the transport or the TLS chunks (resume_writing will
        say when they are out)."""
        return self._write_blocked or self._tls_blocked

    def transport_error(self, exc: ProtocolError) -> None:
        """A message transport found a message that breaks the message rules."""
        if self.state is _READY:
            self._fail(exc, cmd=self._decoder.current_cmd)
        elif self.state is _AWAIT_HELLO or self.state is _AWAIT_AUTH:
            self._after_handshake(self.conn.refuse(exc, self._decoder.current_cmd, exc.seq or 0))

    # -- the handshake ---------------------------------------------------------------

    def _handshake(self, frame: Frame) -> None:
        """A frame before READY: the sans-IO connection judges it."""
        started = time.perf_counter()
        sent = self.ctx.stats.bytes_out
        self._hs_frame = (frame.cmd, frame.seq)
        cmd = _COMMANDS.get(frame.cmd)
        if cmd is not None:
            self.ctx.stats.commands[cmd] += 1
            self.ctx.metrics.command(cmd, HEADER_SIZE + frame.body_len)
        self._after_handshake(self.conn.receive_frame(frame))
        if cmd is not None and (self.state is _READY or self.state is _AWAIT_AUTH):
            self.ctx.metrics.reply(cmd, self.ctx.stats.bytes_out - sent,
                                   time.perf_counter() - started)

    def _after_handshake(self, events: list[Any]) -> None:
        now = self._loop.time()
        for ev in events:
            if type(ev) is Ready:
                if ev.method == TOKEN and self._ticket is not None:
                    # The token's verdict is a guesser's only oracle (an hmac-sha256
                    # server proof already lets anyone test guesses offline): a good
                    # token is answered after this source's failures that still wait,
                    # so hanging up early tells a guesser nothing.
                    at = self.ctx.admission.success_at(self._ticket, now)
                    if at is None or at > now:
                        self._block()
                        self._hold_until(at, functools.partial(self._ready_in_turn, ev))
                        return
                self._ready(ev)
            elif type(ev) is Refused:
                self.state = _CLOSING
                self.ctx.metrics.error(ev.error.code)
                if ev.guess and self._ticket is not None:
                    at, n = self.ctx.admission.failed(self._ticket, now)
                    log.warning(
                        "authentication failed from %s: %s (%d in the last minute; %s)",
                        self.peer, ev.error.message, n,
                        f"answering in {at - now:.2f} s" if at is not None else
                        "no answer before the handshake timeout: closed at it",
                    )
                    # Still counted as not authenticated while it waits.
                    self._hold_until(at, self._flush_and_close)
                    return
                log_client_error(self.peer, ev.error, self._decoder.current_cmd, ev.error.seq)
                self._flush_and_close()
                return
        self._flush_handshake()

    def _hold_until(self, at: float | None, then: Callable[[], None]) -> None:
        """Answer the handshake at ``at`` (``then``); None: at the handshake deadline, with
        TIMEOUT instead of the verdict, whatever the verdict was."""
        if self._timer is not None:
            self._timer.cancel()
        if at is None:
            self._timer = self._loop.call_at(self.conn.deadline, self._answer_at_deadline)
        else:
            self._timer = self._loop.call_at(at, then)

    def _answer_at_deadline(self, why: str = "") -> None:
        """No verdict in time (this source's answers queue up, or the slot gave way): the
        same TIMEOUT and close for a good secret and a bad one, so it tells nothing."""
        self._timer = None
        self.conn.frames_to_send()  # whatever verdict was queued is not sent
        cmd, seq = self._hs_frame
        self.conn.refuse(Timeout(
            f"no verdict within the handshake timeout ({self.conn.settings.handshake_timeout:g}"
            f" s): {why or 'the failed attempts of this source are answered one after another'}"),
            cmd, seq)
        self.state = _CLOSING
        self._flush_and_close()

    def _ready(self, ev: Ready) -> None:
        self.state = _READY
        self.client_name = ev.client
        self._end_handshake()
        if self._write_frame is not None:
            cast(Any, self.transport).recv_limit = self.ctx.max_message
        if ev.method is not None:
            log.debug("%s authenticated (%s) as %r", self.peer, ev.method, ev.client)

    def _ready_in_turn(self, ev: Ready) -> None:
        self._timer = None
        if self.state is _CLOSED:
            return
        self._ready(ev)
        self._flush_handshake()
        self._unblock()

    def _flush_handshake(self) -> None:
        t = self.transport
        out = self.conn.frames_to_send()
        if t is None or t.is_closing():
            return
        for raw in out:
            if self._write_frame is not None:
                self._write_frame(raw, (), 0)
            else:
                t.write(raw)
            self.ctx.stats.bytes_out += len(raw)

    def _flush_and_close(self) -> None:
        self._timer = None
        self._flush_handshake()
        self.close()

    def _handshake_timeout(self) -> None:
        self._timer = None
        self._after_handshake(self.conn.handle_timeout(self._loop.time()))

    def _end_handshake(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._ticket is not None:
            self.ctx.admission.release(self._ticket)
            self._ticket = None

    def _release_held(self) -> None:
        held, self._held = self._held, []
        release_all(held)

    # -- frame flow -----------------------------------------------------------

    def _block(self) -> None:
        self._blockers += 1
        if self._blockers == 1 and self.transport is not None:
            self.transport.pause_reading()

    def _unblock(self) -> None:
        self._blockers -= 1
        if self._blockers == 0 and self.state is not _CLOSED:
            assert self.transport is not None
            self.transport.resume_reading()
            # Frames may already be complete in the decoder's buffer.
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        budget = PUMP_FRAMES
        while self._blockers == 0 and self.state is _READY:
            if budget == 0:
                # Bounded work per turn: other connections' frames run before
                # this one's next (reads pause meanwhile, frames stay in order).
                self._block()
                self._loop.call_soon(self._unblock)
                return
            budget -= 1
            try:
                frame = self._decoder.next_frame()
            except ProtocolError as exc:
                self._fail(exc, cmd=self._decoder.current_cmd)
                return
            if frame is None:
                if self._eof:
                    self.close()
                return
            self._handle(frame)
        state = self.state
        if state is _AWAIT_HELLO or state is _AWAIT_AUTH:
            self._pump_handshake()

    def _pump_handshake(self) -> None:
        while (self.state is _AWAIT_HELLO or self.state is _AWAIT_AUTH) and not self._blockers:
            try:
                frame = self._decoder.next_frame()
            except ProtocolError as exc:
                # The gate (or the decoder) refused a header before READY.
                self._after_handshake(
                    self.conn.refuse(exc, self._decoder.current_cmd, exc.seq or 0)
                )
                return
            if frame is None:
                return
            self._handshake(frame)
        if self.state is _READY:
            self._pump()

    def _sink_for(self, frame: Frame) -> Sink:
        self._sink_error = None
        try:
            if self.ctx.draining:
                raise _stopping()
            self._check_allowed(frame)
            return payload_sink(self, frame)
        except TransferdError as exc:
            self._sink_error = exc
            return DISCARD

    def _check_allowed(self, frame: Frame) -> None:
        if self.state is not _READY:
            raise NoHello("the first frame of a connection must be HELLO")
        if int(frame.flags) & _NOT_REQUEST_FLAGS:
            raise BadRequest("a request must not carry REPLY, ERROR or EVENT flags")
        cmd = _COMMANDS.get(frame.cmd)
        if cmd is None:
            raise UnknownCommand(f"unknown command 0x{frame.cmd:02x}")
        if COMMAND_MINOR[cmd] > self.ctx.minor:
            raise UnknownCommand(
                f"{cmd.name} needs protocol minor {COMMAND_MINOR[cmd]}; this server speaks "
                f"{PROTO_MAJOR}.{self.ctx.minor}"
            )
        if cmd is _AUTH:
            raise BadRequest("AUTH: this connection is already authenticated")
        if cmd not in HANDLERS:
            raise UnknownCommand(f"{cmd.name} is not served by this daemon")
        if frame.refused is not None:  # over a cap the decoder enforced (max_tensors)
            raise frame.refused

    def _handle(self, frame: Frame) -> None:
        started = time.perf_counter()
        cmd = _COMMANDS.get(frame.cmd)
        if cmd is not None:
            self.ctx.stats.commands[cmd] += 1
            self.ctx.metrics.command(cmd, HEADER_SIZE + frame.body_len + frame.payload_len)
        try:
            if self.ctx.draining and not frame.payload_len:
                # A payload frame was judged by its sink when its header came.
                raise _stopping()
            if frame.payload_len:
                # The sink judged it; a discarded payload always has its reason recorded.
                if self._sink_error is not None:
                    raise self._sink_error
                if frame.discarded:
                    raise Internal("payload discarded without a recorded error")
            elif not (
                self.state is _READY
                and cmd is not None
                and not int(frame.flags) & _NOT_REQUEST_FLAGS
                and COMMAND_MINOR[cmd] <= self.ctx.minor
                and cmd in HANDLERS
                and frame.refused is None
            ):  # the usual request passes these; anything else gets the checks' error
                self._check_allowed(frame)
            result = HANDLERS[_COMMANDS[frame.cmd]](self, frame)
        except TransferdError as exc:
            self._fail(exc, frame.cmd, frame.seq, frame.no_reply)
            return
        except Exception as exc:  # a bug must not take the daemon down
            log.exception("internal error on cmd 0x%02x", frame.cmd)
            self._fail(
                Internal(f"{type(exc).__name__}: {exc}"), frame.cmd, frame.seq, frame.no_reply
            )
            return
        if result is None or type(result) is Reply:
            self._reply(frame, result, started)
        elif isinstance(result, Awaitable):
            self._block()
            task = asyncio.ensure_future(self._finish_async(frame, result, started))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._reply(frame, cast(Reply, result), started)

    async def _finish_async(
        self, frame: Frame, pending: Awaitable[Reply | None], started: float
    ) -> None:
        try:
            result = await pending
        except TransferdError as exc:
            self._fail(exc, frame.cmd, frame.seq, frame.no_reply)
        except Exception as exc:
            log.exception("internal error in an asynchronous command")
            self._fail(
                Internal(f"{type(exc).__name__}: {exc}"), frame.cmd, frame.seq, frame.no_reply
            )
        else:
            self._reply(frame, result, started)
        finally:
            self._unblock()

    def _reply(self, frame: Frame, result: Reply | None, started: float) -> None:
        if int(frame.flags) & _NO_REPLY:
            if result is not None and result.hold:
                release_all(result.hold)
            return
        if result is None:
            n = self.send_frame(frame.cmd, _REPLY, frame.seq)
        elif result.sent:  # written by the handler itself (streamed from a device)
            return
        else:
            n = self.send_frame(frame.cmd, _REPLY, frame.seq, result.body, result.payload,
                                result.hold, result.fds)
        self.ctx.metrics.reply(_COMMANDS[frame.cmd], n, time.perf_counter() - started)

    def _fail(
        self, exc: TransferdError, cmd: int, seq: int | None = None, no_reply: bool = False
    ) -> None:
        seq = exc.seq if seq is None else seq
        self.ctx.metrics.error(exc.code)
        # REPLY|ERROR, or EVENT|ERROR for a one-way command (the sans-IO rule).
        flags, close = failure_frame(_NO_REPLY if no_reply else 0, exc)
        # At INFO with the client's address (rate-limited by the log handler).
        log_client_error(self.peer, exc, cmd, seq)
        self.send_frame(cmd, flags, seq or 0, exc.to_body())
        if close:
            self.close()

    # -- output -------------------------------------------------------------------

    def send_frame(
        self,
        cmd: int,
        flags: int,
        seq: int,
        body: dict[str, Any] | None = None,
        payload: Sequence[memoryview] = (),
        hold: Sequence[Ref] = (),
        fds: Sequence[int] = (),
    ) -> int:
        """Write one frame; payload views are sent from where they lie.

        ``hold`` (Refs on the memory of ``payload``) is released once the
        bytes are out of the transport's write buffer.  ``fds`` (unix and
        seqpacket connections only) go with the frame's first byte; the
        client takes them for the frame that announces them (the caller keeps
        its own descriptors).
        """
        if self.state is _CLOSED or self.transport is None or self.transport.is_closing():
            release_all(hold)
            return 0
        raw = frames.pack_body(body) if body else b""
        plen = sum(map(len, payload)) if payload else 0
        # encode_header(), inlined: this runs once per reply.
        head = _pack_header(MAGIC, cmd, int(flags), seq & 0xFFFFFFFF, len(raw), 0, plen) + raw
        if fds:
            send_fds = getattr(self.transport, "send_fds", None)
            if send_fds is None:
                release_all(hold)
                raise BadRequest("file descriptors travel only over unix:// and seqpacket://")
            send_fds(fds)
        if self._tls_out is not None:
            # TLS: the SSL layer copies what it is given, so a chunk at a time as the
            # connection drains; a reader that does not read costs about two chunks.
            if self._tls_out.send((head, *payload), hold) and not self._tls_blocked:
                self._tls_blocked = True
                self._block()
        elif self._write_frame is not None:
            # A message transport: header and body one message, the payload
            # cut into max_message messages, sent from where it lies.
            self._write_frame(head, payload, plen)
            if hold:
                if self.transport.get_write_buffer_size():
                    self._held.extend(hold)
                else:
                    release_all(hold)
        elif plen <= SMALL_REPLY:
            if COUNTING and plen:
                count("session.reply_join", plen)
            self.transport.write(b"".join((head, *payload)) if plen else head)
            if hold:
                # The payload was copied into the joined bytes, but descriptors
                # go by number when the write does: hold them open until then.
                if fds and self.transport.get_write_buffer_size():
                    self._held.extend(hold)
                else:
                    release_all(hold)
        else:
            # One call for all views: the transport sends them together
            # (a write per view would be a send syscall per tensor).
            self.transport.writelines((head, *payload))
            if hold:
                if self.transport.get_write_buffer_size():
                    # Still queued: resume_writing (or connection_lost) lets go.
                    self._held.extend(hold)
                else:
                    release_all(hold)
        n = HEADER_SIZE + len(raw) + plen
        self.ctx.stats.bytes_out += n
        return n

    def close(self) -> None:
        if self.state is not _CLOSED:
            self.state = _CLOSED
            if self.transport is not None:
                self.transport.close()

    # -- HELLO ----------------------------------------------------------------------

    def hello(self, frame: Frame) -> Reply:
        """A HELLO after READY (the first one is the handshake's)."""
        raise BadRequest("HELLO was already received on this connection")
