"""One client connection: asyncio feeds the sans-IO ServerConnection and writes what it returns.

The whole protocol of the connection (the handshake, the pre-auth limits and timeout,
the request gate, the checks of every request, answers, EVENT frames, CLOSING) is
:class:`transferd.protocol.connection.ServerConnection`.  This layer only:

- hands the transport the decoder's buffers (bytes land where the decoder says: a SET's
  target tensor, via ``payload_sink``), and pulls events from ``next_event``;
- runs each request it is handed through the command table (``handlers.HANDLERS``), in
  order, one at a time (an asynchronous handler holds the gate until it has finished);
- writes every frame the connection queues through the transport kind's
  :class:`~transferd.transports.carriers.Carrier`, at once (a GET's reply is out before
  the next request runs), and tells the connection when the write buffer is full
  (``pause_writing``: a high-water mark of zero on tcp, unix and seqpacket, so reads
  pause whenever replies wait; GET payloads are sent from the buffer where they lie);
- pauses and resumes reading as the connection's ``wants_read`` says, runs its one
  timer (``timer_at``), and closes the transport when it ``should_close``;
- holds the pre-auth slot (transferd/preauth.py) until the handshake ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from transferd import authlog
from transferd.logs import log_client_error
from transferd.memory import Ref, release_all
from transferd.preauth import Ticket, Why
from transferd.protocol.connection import (
    ConnState,
    Flow,
    Inbound,
    Outgoing,
    Phase,
    Ready,
    Refused,
    ServerConnection,
    ServerSettings,
)
from transferd.protocol.constants import HEADER_SIZE, Command, Flag
from transferd.protocol.errors import (
    Cancelled,
    Internal,
    ProtocolError,
    TransferdError,
    UnknownCommand,
)
from transferd.protocol.frames import Frame, Sink
from transferd.protocol.frames import Phase as DecoderPhase
from transferd.service import Caller
from transferd.transports import TransportKind
from transferd.transports.builtin import Tcp
from transferd.transports.carriers import Carrier

from .context import ServerContext
from .device_io import Landings
from .handlers import HANDLERS, Reply, payload_sink, session_closed

log = logging.getLogger("transferd.session")

# Frames one connection runs in one turn of the loop before yielding to the
# others (a handler's own work is bounded separately: large clears and copies
# go in slices).
PUMP_FRAMES = 64
# And the time they may take in one turn: 64 bounds the count, not the cost (64
# pipelined STATS listing what is in flight held the loop 6 s, every client waiting).
PUMP_SECONDS = 0.005

# Hot-path lookups: calling an IntEnum or combining IntFlags runs Python code.
_COMMANDS: dict[int, Command] = {int(c): c for c in Command}
_ERROR = int(Flag.ERROR)
_EVENT = int(Flag.EVENT)

# The session's states are the connection's (HELLO, AUTH, READY, CLOSING, CLOSED); the
# name State stays for callers that knew it.
State = ConnState

# Module-level aliases for the per-frame path: in Python 3.11 ``State.X`` goes through
# EnumType.__getattr__, ten times slower than a global.
_READY = ConnState.READY
_CLOSED = ConnState.CLOSED
_BLOCKED = Flow.BLOCKED
_OPEN_F = Flow.OPEN
_IDLE_P = Phase.IDLE
_IN_OPEN = Inbound.OPEN
_PAYLOAD = DecoderPhase.PAYLOAD
_HEADER = DecoderPhase.HEADER
_FRAME = Frame
_REPLY_T = Reply
_TCP = Tcp()


def _stopping() -> Cancelled:
    return Cancelled("the daemon is stopping (SIGTERM, draining): request refused, "
                     "nothing done; retry on another daemon or after the restart")


class Session(asyncio.BufferedProtocol):
    def __init__(self, ctx: ServerContext, settings: ServerSettings | None = None,
                 kind: TransportKind | None = None) -> None:
        self.ctx = ctx
        # The node's metrics (a property of the context: looked up once, not per frame).
        self._metrics = ctx.metrics
        self.kind = kind or _TCP
        self.peer = "?"
        self.source = "?"
        self.client_name = ""
        self.transport: asyncio.Transport | None = None
        self.carrier: Carrier | None = None
        self._loop = asyncio.get_running_loop()
        # When bytes last came in or the write buffer last emptied: the drain at SIGTERM
        # lingers on a connection active in the last moments (its next request may be
        # on the wire already), see rpc_server/drain.py.
        self.last_active = self._loop.time()
        self.conn = ServerConnection(
            settings or ctx.settings_for("tcp"), self._loop.time(), payload_sink=self._sink_for
        )
        # The transport asks the decoder directly: one Python call less per read.
        self.get_buffer = self.conn.decoder.get_buffer  # type: ignore[method-assign]
        # The pre-auth slot (transferd/preauth.py) until the handshake ends.
        self._ticket: Ticket | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._reading = True
        # Set while this connection yields its turn to others (a bounded pump).
        self._again: asyncio.Handle | None = None
        # This connection as the node's Service knows it: the owner of what it makes,
        # its pending operations by seq, the submits it has in flight.
        self.caller = Caller()
        # SET frames whose payload went to device staging, until their handler runs.
        self.landings = Landings()
        # Per batch command, the last batch looked up in one pass: its tensor list and
        # runs (handlers.batch_views); a repeat of the same body skips the per-row check.
        self.batches: dict[int, tuple[list[Any], list[Any]]] = {}
        self._tasks: set[asyncio.Future[None]] = set()
        # Called once the write buffer has drained (WATCH streams send what waited).
        self.drained_hooks: set[Callable[[], None]] = set()
        # Called at the next drain only (watchers whose last EVENT waited in the buffer):
        # at most one per watcher of this connection (engine.max_watchers_per_connection).
        self.at_next_drain: list[Callable[[], None]] = []
        # Completion EVENTs after the first of this turn of the loop (send_event): None
        # while no turn has sent one; written in one go at the turn's end, or before any
        # other frame (they neither overtake nor trail what is written after them).
        # Bounded by the submits in flight (engine.max_inflight_per_client).
        self._events: list[Outgoing] | None = None
        # While a reply writes its own payload piece by piece (a GET from device memory,
        # device_io.stream_reply), every other frame of this connection waits here and
        # goes once that payload is whole: written inside it, a frame would be read as
        # payload. Bounded as what makes them is (submits in flight, one EVENT per
        # watcher until it is out).
        self._held: list[Outgoing] | None = None

    @property
    def state(self) -> ConnState:
        return self.conn.state

    @property
    def pending(self) -> set[asyncio.Future[Any]]:
        """Engine operations this connection submitted that have not finished
        (SYNCHRONIZE and the drain wait for them)."""
        return self.caller.pending

    @property
    def receiving(self) -> bool:
        """A frame's payload has begun to arrive and is not all in: the drain waits for
        it (a SET that began to land runs to its end; one refused is read to its end and
        answered, not cut off under its payload)."""
        return self.conn.decoder.phase is _PAYLOAD

    @property
    def write_blocked(self) -> bool:
        """Unsent bytes wait in the transport or the TLS chunks (resume_writing will say
        when they are out), or frames wait behind a streamed reply (hold_frames;
        release_frames says when they went)."""
        return self.conn.flow is _BLOCKED or self._held is not None

    # -- asyncio callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but are one.
        self.transport = t = cast(asyncio.Transport, transport)
        self.carrier = self.kind.carrier(transport, server=True,
                                         join_counter="session.reply_join")
        # Reads pause whenever a reply waits (GET payloads are sent from where they lie).
        self.carrier.pause_on_any_byte()
        self.source, self.peer = self.kind.identity(transport)
        self.caller.source, self.caller.peer = self.source, self.peer
        self.ctx.metrics.connections.inc()
        self.ctx.metrics.connections_accepted.inc()
        admitted = self.ctx.admission.admit(self.source, self._loop.time(), self)
        self.ctx.gave_way(admitted.closed)
        if admitted.ticket is None:
            self.ctx.note_refused_connection(self.source, admitted.reason)
            self.conn.close()
            t.abort()
            return
        self._ticket = admitted.ticket
        self.conn.verdicts = self.ctx.admission.verdicts(admitted.ticket)
        self.ctx.sessions.add(self)
        self._arm_timer()
        log.debug("connection from %s", self.peer)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn.phase is Phase.AUTH:
            # It had the server's proof and went: a client checks the proof and hangs
            # up when it does not match its own secret (PROTOCOL.md, Authentication).
            authlog.client_failed(self.peer, "wrong_secret", "the client hung up after the "
                                  "server's proof (hmac-sha256): its token differs from "
                                  "this daemon's server.token (or it dialled another daemon)")
        if self.conn.state is not _CLOSED:
            self.conn.connection_lost()
        self._end_handshake()
        self.ctx.metrics.connections.dec()
        self.ctx.sessions.discard(self)
        if self.carrier is not None:
            self.carrier.close()
        session_closed(self)  # what this connection owned and waited on
        # No reference cycle through this session is left for the cyclic collector: its
        # connection lets go of the session's methods, and the session of its transport
        # (uvloop's TLS transport keeps this session's buffer_updated after the loss).
        self.conn.detach()
        self.transport = None
        self.carrier = None
        log.debug("connection from %s closed (%s)", self.peer, exc or "eof")

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.conn.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        d = self.conn.decoder
        if d._direct:
            d.buffer_updated(nbytes)
        else:
            d._end += nbytes  # FrameDecoder.buffer_updated, the usual case inlined
        self.ctx.stats.bytes_in += nbytes
        self.last_active = self._loop.time()
        self._pump()

    def eof_received(self) -> bool:
        # A half-close says "that is all I send", not "drop what I sent": the frames
        # already received still run, in order, and the connection closes once the last
        # of them has (the client keeps reading until then).
        if not self.conn.eof():
            return False
        self._loop.call_soon(self._pump)
        return True

    def pause_writing(self) -> None:
        self.conn.output_blocked()

    def resume_writing(self) -> None:
        # The write buffer is empty (low watermark 0): every payload is out.
        if self.carrier is not None and not self.carrier.drained():
            return  # TLS: chunks still wait (a write here may pause writing again)
        self.last_active = self._loop.time()
        self.conn.output_drained()
        self._output_drained()
        if self.conn.state is _READY:
            self._loop.call_soon(self._pump)

    def _output_drained(self) -> None:
        # Peer messages handed to this connection are out: their senders' ACKs.
        self.ctx.service.drained(self.caller)
        if self.drained_hooks:
            for hook in list(self.drained_hooks):
                hook()
        if self.at_next_drain:
            once, self.at_next_drain = self.at_next_drain, []
            for hook in once:
                hook()

    def transport_error(self, exc: ProtocolError) -> None:
        """A message transport found a message that breaks the message rules."""
        if self.conn.state is _READY or self.conn.state is ConnState.HELLO or \
                self.conn.state is ConnState.AUTH:
            self._on_event(self.conn.broken(exc))
            self._after()

    # -- the pump -------------------------------------------------------------------------

    def _pump(self) -> None:
        """Run what the connection hands out: requests in order, handshake events."""
        self._again = None
        conn = self.conn
        budget = PUMP_FRAMES
        until = time.perf_counter() + PUMP_SECONDS
        ev: Any
        while True:
            ev = conn.next_event() if conn.state is _READY else conn.next_event(
                self._loop.time())
            if ev is None:
                break
            if type(ev) is _FRAME:
                self._run(ev)
                budget -= 1
                if budget == 0 or time.perf_counter() > until:
                    # Bounded work per turn: other connections' frames run before this
                    # one's next (reads pause meanwhile, frames stay in order).
                    self._again = self._loop.call_soon(self._pump)
                    break
                d = conn.decoder
                if d._start == d._end and d.phase is _HEADER and conn.inbound is _IN_OPEN:
                    if d._small:
                        d._quiet()  # (as next_frame would: a quiet connection's buffer small)
                    break  # next_event's "nothing buffered", without the call (per frame)
            else:
                self._handshake(ev)
        self._after()

    def _handshake(self, ev: Ready | Refused) -> None:
        """A handshake event, and the counts of the frames that made it (STATS, metrics)."""
        started = time.perf_counter()
        sent = self.ctx.stats.bytes_out
        self._on_event(ev)
        self._flush()
        frames, self.conn.handshake_frames = self.conn.handshake_frames, []
        for f in frames:
            cmd = _COMMANDS.get(f.cmd)
            if cmd is None:
                continue
            self.ctx.stats.commands[cmd] += 1
            self.ctx.metrics.command(cmd, HEADER_SIZE + f.body_len)
            if type(ev) is Ready or self.conn.state is ConnState.AUTH:
                self.ctx.metrics.reply(cmd, self.ctx.stats.bytes_out - sent,
                                       time.perf_counter() - started)

    def _after(self) -> None:
        """Write what is queued, and make the transport and the timer follow the
        connection: reading while it wants bytes, closed once it should close."""
        conn = self.conn
        if conn.out:
            self._flush()
        t = self.transport
        if t is None:
            return
        if conn.phase is _IDLE_P and conn.flow is _OPEN_F and conn.inbound is _IN_OPEN:
            want = self._again is None  # conn.wants_read, the usual case inlined
        else:
            if conn.should_close:
                self.close()
                return
            want = conn.wants_read and self._again is None
        if want is not self._reading:
            self._reading = want
            if want:
                t.resume_reading()
            else:
                t.pause_reading()
        if self._ticket is not None or self._timer is not None:
            self._arm_timer()

    def _flush(self) -> int:
        """Write the frames the connection queued itself (the handshake, refusals)."""
        conn = self.conn
        if not conn.out:
            return 0
        out, conn.out = conn.out, []
        n = 0
        for o in out:
            n += self._write(o)
        return n

    def _write(self, o: Outgoing) -> int:
        """Write one frame (payload views from where they lie); the bytes written."""
        if self._held is not None:
            self._held.append(o)  # a reply streams its payload: after it (hold_frames)
            return len(o.head) + o.payload_len
        if self._events:
            self._write_events()
        carrier, t = self.carrier, self.transport
        if carrier is None or t is None or t.is_closing():
            release_all(o.hold)
            return 0
        if o.fds:
            assert carrier.fds is not None  # _answer refuses descriptors elsewhere
            carrier.fds.send(o.fds)
        carrier.write(o.head, o.payload, o.payload_len, o.hold)
        n = len(o.head) + o.payload_len
        self.ctx.stats.bytes_out += n
        if carrier.queues and carrier.busy:
            self.conn.output_blocked()  # TLS chunks wait: resume_writing pumps them
        return n

    # -- requests ---------------------------------------------------------------------------

    def _sink_for(self, frame: Frame) -> Sink:
        # The connection checked the request first; it records any error raised here.
        if self.ctx.draining:
            raise _stopping()
        return payload_sink(self, frame)

    def _run(self, frame: Frame) -> None:
        started = time.perf_counter()
        ctx = self.ctx
        cmd = _COMMANDS.get(frame.cmd)
        if cmd is not None:
            ctx.stats.commands[cmd] += 1
            self._metrics.command(cmd, HEADER_SIZE + frame.body_len + frame.payload_len)
        if frame.refused is not None:  # the connection's checks, or the sink's
            # Answered as raised, but not raised: a traceback on the error the frame
            # holds would be a reference cycle (through this frame of _run) per refusal.
            self._fail(frame, frame.refused)
            return
        try:
            if ctx.draining and not frame.payload_len:
                # A payload frame was judged by its sink when its header came.
                raise _stopping()
            if frame.discarded:
                raise Internal("payload discarded without a recorded error")
            handler = HANDLERS.get(cmd) if cmd is not None else None
            if cmd is None or handler is None:
                raise UnknownCommand(f"0x{frame.cmd:02x} is not served by this daemon")
            result = handler(self, frame)
            if type(result) is _REPLY_T and result.lies_in and (
                    self.carrier is None
                    or sum(map(len, result.payload)) > self.carrier.joins_up_to):
                result = self._hold(result)  # (Carrier.keeps, inlined: per frame)
        except TransferdError as exc:
            self._fail(frame, exc)
            return
        except Exception as exc:  # a bug must not take the daemon down
            log.exception("internal error on cmd 0x%02x", frame.cmd)
            self._fail(frame, Internal(f"{type(exc).__name__}: {exc}"))
            return
        if result is None or (type(result) is _REPLY_T and not result.fds and not result.sent):
            # The usual answer, written here (_answer and _write, inlined: per frame).
            conn = self.conn
            if result is None:
                o = conn.answer(frame)
            else:
                o = conn.answer(frame, result.body, result.payload, result.hold)
                if o is None:
                    release_all(result.hold)
            if o is None:
                return
            if self._held is not None:
                self._held.append(o)  # (as _write does while a reply streams)
                return
            if self._events:
                self._write_events()  # as _write does: completions go before this reply
            carrier, t = self.carrier, self.transport
            if carrier is None or t is None or t.is_closing():
                release_all(o.hold)
                return
            carrier.write(o.head, o.payload, o.payload_len, o.hold)
            n = len(o.head) + o.payload_len
            ctx.stats.bytes_out += n
            if carrier.queues and carrier.busy:
                conn.output_blocked()
            if cmd is not None:
                self._metrics.reply(cmd, n, time.perf_counter() - started)
        elif type(result) is _REPLY_T:
            self._answer(frame, result, started)
        elif isinstance(result, Awaitable):
            task = asyncio.ensure_future(self._finish_async(frame, result, started))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._answer(frame, cast(Reply, result), started)

    async def _finish_async(
        self, frame: Frame, pending: Awaitable[Reply | None], started: float
    ) -> None:
        try:
            result = await pending
            if type(result) is _REPLY_T and result.lies_in:
                result = self._hold(result)
        except TransferdError as exc:
            self._fail(frame, exc)
        except Exception as exc:
            log.exception("internal error in an asynchronous command")
            self._fail(frame, Internal(f"{type(exc).__name__}: {exc}"))
        else:
            self._answer(frame, result, started)
        if self.conn.state is _READY:
            self._pump()  # the gate is open again: the frames behind it
        else:
            self._after()

    def _hold(self, result: Reply) -> Reply:
        """Refs on the buffers a reply's views lie in, where the carrier keeps the views
        past the write (the views were taken this turn: no free came between)."""
        carrier = self.carrier
        if carrier is not None and not carrier.keeps(sum(map(len, result.payload))):
            return result._replace(lies_in=())
        return result._replace(hold=[*result.hold, *(b.ref() for b in result.lies_in)],
                               lies_in=())

    def _answer(self, frame: Frame, result: Reply | None, started: float) -> None:
        conn = self.conn
        if result is None:
            o = conn.answer(frame)
        elif result.sent:  # written by the handler itself (streamed from a device)
            conn.answered(frame)
            return
        else:
            if result.fds and (self.carrier is None or self.carrier.fds is None):
                release_all(result.hold)
                self._fail(frame, UnknownCommand(
                    "file descriptors travel only over unix:// and seqpacket://"))
                return
            o = conn.answer(frame, result.body, result.payload, result.hold, result.fds)
            if o is None:
                release_all(result.hold)
        if o is not None:
            n = self._write(o)
            self.ctx.metrics.reply(_COMMANDS[frame.cmd], n, time.perf_counter() - started)

    def _fail(self, frame: Frame, exc: TransferdError) -> None:
        self.ctx.metrics.error(exc.code)
        # At INFO with the client's address (rate-limited by the log handler).
        log_client_error(self.peer, exc, frame.cmd, frame.seq)
        o = self.conn.fail(frame, exc)
        if o is not None:
            self._write(o)

    # -- the handshake -----------------------------------------------------------------------

    def _on_event(self, ev: Ready | Refused) -> None:
        ctx = self.ctx
        if type(ev) is Ready:
            self.client_name = ev.client
            self._end_handshake()
            if self.carrier is not None:
                self.carrier.set_message_limits(ctx.max_message, ctx.max_message)
            if ev.method is not None:
                log.debug("%s authenticated (%s) as %r", self.peer, ev.method, ev.client)
            return
        assert type(ev) is Refused
        ctx.metrics.error(ev.error.code)
        if ev.guess:
            when = ("no answer before the handshake timeout: closed at it"
                    if ev.answer_at is None and self.conn.verdicts is not None else
                    f"answering in {max(0.0, (ev.answer_at or 0) - self._loop.time()):.2f} s")
            authlog.client_failed(self.peer, ev.reason, f"{ev.error.message} ({ev.failures} in "
                                  f"the last minute; {when})")
        elif ev.reason:  # no secret given, an AUTH that never came: as a failed authentication
            authlog.client_failed(self.peer, ev.reason, ev.error.message)
        else:
            log_client_error(self.peer, ev.error, self.conn.decoder.current_cmd, ev.error.seq)

    def give_way(self, why: Why) -> None:
        """The admission handed this connection's pre-auth slot to a newer one."""
        self._ticket = None
        for ev in self.conn.give_way(why.value):
            self._on_event(ev)
        self._after()

    def _arm_timer(self) -> None:
        at = self.conn.timer_at
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            self._timer = self._loop.call_at(at, self._timeout)

    def _timeout(self) -> None:
        self._timer = None
        self._timer_at = None
        for ev in self.conn.handle_timeout(self._loop.time()):
            self._on_event(ev)
        if self.conn.state is _READY:
            self._pump()  # a held verdict went out: the frames behind it
        else:
            self._after()

    def _end_handshake(self) -> None:
        if self._ticket is not None:
            self.ctx.admission.release(self._ticket)
            self._ticket = None

    # -- output for handlers ---------------------------------------------------------------

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
        """An EVENT frame (``flags``: EVENT, or EVENT|ERROR), sent unasked; the bytes
        written (0 once the connection is closing).  Payload views are sent from where
        they lie and ``hold`` released once they are out."""
        if not int(flags) & _EVENT:
            raise Internal(f"send_frame is for EVENT frames (flags 0x{int(flags):02x})")
        o = self.conn.event(cmd, seq, body, error=bool(int(flags) & _ERROR),
                            payload=payload, hold=hold, fds=fds)
        if o is None:
            release_all(hold)
            return 0
        return self._write(o)

    def send_event(self, cmd: int, flags: int, seq: int, body: dict[str, Any]) -> None:
        """A completion EVENT (no payload): the first of a turn of the loop goes at once,
        those after it in the same turn go together at its end (a burst of completions
        is one write, a lone one waits for nothing)."""
        events = self._events
        if events is None:
            self.send_frame(cmd, flags, seq, body)
            self._events = []
            self._loop.call_soon(self._events_turn_ended)
            return
        o = self.conn.event(cmd, seq, body, error=bool(flags & _ERROR))
        if o is not None:
            events.append(o)

    def _events_turn_ended(self) -> None:
        if self._events:
            self._write_events()
        self._events = None

    def _write_events(self) -> None:
        events = self._events
        assert events
        self._events = []
        if self._held is not None:
            self._held.extend(events)
            return
        carrier, t = self.carrier, self.transport
        if carrier is None or t is None or t.is_closing():
            return
        heads = [o.head for o in events]
        carrier.write_heads(heads)
        self.ctx.stats.bytes_out += sum(map(len, heads))

    def hold_frames(self) -> None:
        """From now until :meth:`release_frames`, this connection's other frames wait:
        the caller writes a reply's payload to the transport itself, in pieces."""
        if self._held is None:
            self._held = []

    def release_frames(self) -> None:
        """The streamed payload is whole (or the connection is closing): what waited
        goes, in order."""
        held, self._held = self._held, None
        for o in held or ():
            self._write(o)
        if held is not None and self.conn.flow is not _BLOCKED:
            # All out, and no resume_writing will come to say so: what paced itself on
            # write_blocked meanwhile goes on (messages' ACKs, WATCH changes).
            self._output_drained()

    def stream_head(self, frame: Frame, payload_len: int) -> bytes:
        """The header of a reply a handler writes itself (streamed from device memory)."""
        return self.conn.streamed_head(frame, payload_len)

    def close(self) -> None:
        if self._events:
            self._write_events()  # (before the connection stops making frames)
        self.conn.close()
        t = self.transport
        if t is not None and not t.is_closing():
            self._flush()
            t.close()

    # -- HELLO ----------------------------------------------------------------------------

    def hello(self, frame: Frame) -> Reply:
        """A HELLO after READY (the first one is the handshake's)."""
        from transferd.protocol.errors import BadRequest

        raise BadRequest("HELLO was already received on this connection")
