"""The engine half of the client: regions, one-sided writes, ImmCounter, send/recv.

Submits are one-way frames (NO_REPLY); each returns a :class:`Completion` at
once, which the daemon resolves with an EVENT frame carrying the submit's
seq when the transfer was applied at its destination (or failed).  A
Completion is an awaitable, takes callbacks, and is a flag (``done()``).

Every submit and expectation ends exactly once: done, failed, timed out or
cancelled.  ``timeout=`` (seconds) is its deadline on the daemon;
``await completion.cancel()`` ends one early.  A ``Timeout`` or a
``Cancelled`` of a write says the daemon stopped waiting, not that nothing
landed: parts already sent may still land and count at the destination (the
outcome is unknown; docs/engine.md, "Deadlines and cancelling").  A write
retried with the same ``wid=`` (write id) is applied and counted at most once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transferd.copies import COUNTING, count
from transferd.protocol.constants import Command, Flag
from transferd.protocol.errors import ConnectionLost, NotFound, TransferdError, error_from_body
from transferd.protocol.frames import Frame
from transferd.protocol.values import MrDesc, NetAddr, Pages, ScatterDst

from .replies import reply_field, reply_uint
from .tracing import tag as _tag

if TYPE_CHECKING:
    from .buffers import RemoteBuffer
    from .calls import Calls

log = logging.getLogger("transferd.client")


@dataclass(frozen=True)
class MrHandle:
    """A region registered on this client's daemon: the source of writes."""

    id: int
    buffer: RemoteBuffer


@dataclass(frozen=True)
class PeerGroup:
    id: int
    addrs: tuple[NetAddr, ...]


class Completion:
    """The end of a submit (or an immediate count being reached)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # CANCEL of the request this is the end of: (client, its seq).
        self._origin: tuple[Calls, int] | None = None
        # Its registration was given up before its reply (see :func:`registered`).
        self._given_up = False

    async def cancel(self) -> bool:
        """Ask the daemon to end this now (CANCEL); True if that is how it ended.

        When this returns, the Completion has ended: with ``Cancelled`` (True),
        or with what it ended with before the cancel arrived (False).  A
        cancelled write may still have landed in part (see the module doc).
        """
        if self.done() or self._origin is None:
            return False
        client, seq = self._origin
        try:
            r = await client.conn.request(Command.CANCEL, {"seq": seq}, timeout=client.timeout)
        except NotFound:
            return False  # it ended first; its EVENT came (or comes) before our reply
        return bool(r.body.get("cancelled"))

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[Completion], None]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def result(self) -> Any:
        return self._future.result()

    def exception(self) -> BaseException | None:
        return self._future.exception()

    def __await__(self) -> Any:
        try:
            return (yield from self._future.__await__())
        except asyncio.CancelledError:
            # The awaiting task was cancelled (asyncio.wait_for, a TaskGroup) and took the
            # future with it: nobody can read this one's end any more, so the operation is
            # cancelled where it runs too, before it takes more (an expectation's count,
            # a write's unsent parts, an armed write's firing).  ``wait`` is the way to
            # stop waiting and leave it running.
            fut = self._future
            if fut.cancelled():
                self._abandoned()
            elif fut.done() and fut.exception() is None:
                # It ended done in the loop turn its awaiter was cancelled in (before the
                # task ran again): what it did stands, and nobody will read it.
                abandoned_ended(self)
            raise

    def _abandoned(self) -> asyncio.Future[Frame] | None:
        """CANCEL, sent and not waited for (its reply, or that it ended first, is dropped);
        the reply's future, None when nothing was sent."""
        if self._origin is None:
            return None
        client, seq = self._origin
        try:
            reply = client.conn.request(Command.CANCEL, {"seq": seq}, timeout=client.timeout)
        except TransferdError:
            return None  # not connected any more: the close ended it on the daemon
        reply.add_done_callback(_dropped)
        return reply

    async def wait(self, timeout: float | None = None) -> Any:
        # Neither wait_for nor shield: their futures and done callbacks are two loop
        # turns more per wait (an MoE step waits six times), and one already ended needs
        # none.  The waiter is this wait's own: a timed-out or cancelled wait cancels it,
        # never the Completion.
        fut = self._future
        if not fut.done():
            waiter = fut.get_loop().create_future()

            def wake(_: Any) -> None:
                if not waiter.done():
                    waiter.set_result(None)

            fut.add_done_callback(wake)
            try:
                if timeout is None:
                    await waiter
                else:
                    async with asyncio.timeout(timeout):
                        await waiter
            finally:
                fut.remove_done_callback(wake)
        return fut.result()

    def _resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        if self._future.done():
            return
        if error is not None:
            self._future.set_exception(error)
            # A failure somebody never awaited is still reported by the flush
            # points; don't also warn about an unretrieved exception.
            self._future.exception()
        else:
            self._future.set_result(value)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Completion {self.what} {state}>"


MessageHandler = Callable[[bytes], None]
# submit_recvs(..., traced=True): (message, the sender's traceparent or None).
TracedMessageHandler = Callable[[bytes, "str | None"], None]


def _dropped(reply: asyncio.Future[Any]) -> None:
    if not reply.cancelled():
        reply.exception()  # (retrieved: NOT_FOUND when it had ended first, or a lost link)


def _ms(seconds: float) -> int:
    """A deadline in whole milliseconds (0 is refused by the daemon, not rounded up)."""
    return max(0, round(seconds * 1000))


def if_reached(callback: Callable[[], None]) -> Callable[[Completion], None]:
    """An expectation's done callback: ``callback()`` only if its count was reached (not
    for a failure, nor when its awaiter's cancel took the future)."""
    def done(c: Completion) -> None:
        if not c._future.cancelled() and c._future.exception() is None:
            callback()
    return done


def abandoned_ended(c: Completion) -> None:
    """An operation ended done as or after its awaiter was cancelled (before a CANCEL
    could reach it): what it did stands (an expectation's count is consumed)."""
    log.warning("%s ended done as the task awaiting it was cancelled: what it did stands "
                "(an expectation's count was consumed), and nobody awaits it", c.what)


def _never_registered(cancel: asyncio.Future[Frame], c: Completion, events: EngineEvents,
                      seq: int) -> None:
    """The CANCEL of a registration given up before its reply was NOT_FOUND while ``c``
    still waits: an operation that had ended sent its EVENT before that reply, so this
    one was refused, never registered, and no EVENT will come for it."""
    if (not cancel.cancelled() and isinstance(cancel.exception(), NotFound)
            and events.waiting.get(seq) is c):
        del events.waiting[seq]


async def registered(reply: asyncio.Future[Frame], c: Completion, events: EngineEvents,
                     seq: int) -> None:
    """The reply to the request that registers ``c`` (an expectation, an armed write),
    whose EVENT may come first.  Refused, no EVENT will end it; given up (the caller
    cancelled) before the reply, it may stand on the daemon: cancelled there too."""
    try:
        await reply
    except asyncio.CancelledError:
        # It may stand on the daemon: cancelled there, its EVENT still routed to ``c``
        # (the CANCEL's EVENT|ERROR taken quietly, not raised at a later flush point;
        # one that fired first said with a warning, never a count lost without a word).
        if c.done():
            if not c._future.cancelled() and c._future.exception() is None:
                abandoned_ended(c)  # (its EVENT came in the turn the cancel did)
        else:
            c._given_up = True
            cancel = c._abandoned()
            if cancel is None:
                events.waiting.pop(seq, None)  # (the connection is gone: nothing comes)
            else:
                cancel.add_done_callback(lambda f: _never_registered(f, c, events, seq))
        raise
    except BaseException:
        events.waiting.pop(seq, None)
        raise


class EngineEvents:
    """Routes EVENT frames to the Completion or receive callback they belong to."""

    def __init__(self) -> None:
        self.waiting: dict[int, Completion] = {}
        # SUBMIT_RECVS seq -> its callback: its receives stay posted until the connection
        # closes (bounded by the daemon's engine.max_recv_pools); forgotten if the post
        # was refused (an EVENT|ERROR of its seq).
        self.receivers: dict[int, MessageHandler] = {}
        # The posts made with traced=True: their callbacks take the traceparent too.
        self.traced: set[int] = set()
        # ALLOC_UVM_WATCHER seq -> the watcher's EVENT handler (client.watchers).
        self.watchers: dict[int, Callable[[Frame], None]] = {}

    def on_event(self, frame: Frame) -> bool:
        if frame.cmd == Command.ALLOC_UVM_WATCHER and not frame.is_error:
            route = self.watchers.get(frame.seq)
            if route is None:
                return False
            try:
                route(frame)
            except Exception:  # the user's callback: it must not break the connection
                log.exception("watcher callback failed")
            return True
        if frame.cmd == Command.SUBMIT_RECVS:
            if frame.is_error:
                self.receivers.pop(frame.seq, None)
                self.traced.discard(frame.seq)
                return False  # the post's failure: raised at the next flush point
            cb: Any = self.receivers.get(frame.seq)
            if cb is not None:
                if COUNTING:
                    count("client.recv_message", frame.payload_len)
                try:
                    if frame.seq in self.traced:
                        tp = frame.body.get("traceparent")
                        cb(bytes(frame.payload or b""), tp if isinstance(tp, str) else None)
                    else:
                        cb(bytes(frame.payload or b""))
                except Exception:  # the user's callback: it must not break the connection
                    log.exception("receive callback failed")
                return True
            return False
        c = self.waiting.pop(frame.seq, None)
        if c is None:
            return False
        if (c._future.cancelled() or c._given_up) and not frame.is_error:
            abandoned_ended(c)
        if frame.is_error:
            c._resolve(error=error_from_body(frame.body, seq=frame.seq, fatal=False))
        else:
            c._resolve(frame.body)
        return True

    def lost(self, exc: TransferdError) -> None:
        waiting, self.waiting = self.waiting, {}
        for c in waiting.values():
            c._resolve(error=ConnectionLost(exc.message))


class EngineOps:
    """The engine operations of a Client: regions, writes, peer groups, messages, counts."""

    def __init__(self, client: Calls, events: EngineEvents) -> None:
        self._client = client
        self._events = events

    async def main_address(self) -> NetAddr:
        r = await self._client._call(Command.MAIN_ADDRESS)
        return NetAddr.from_bytes(reply_field(r, "addr", bytes))

    async def reg_mr(self, buf: RemoteBuffer, access: str = "w") -> tuple[MrHandle, MrDesc]:
        """``access``: what peers may do through the MrDesc's rkeys: ``"w"`` write (the
        default), ``"r"`` read (submit_single_read ...), ``"rw"`` both."""
        body: dict[str, Any] = {"buffer": buf.id}
        if access != "w":
            body["access"] = access  # (a daemon before reads refuses nothing it knows)
        r = await self._client._call(Command.REG_MR, body)
        return MrHandle(reply_uint(r, "mr"), buf), MrDesc.from_wire(reply_field(r, "desc", list))

    async def dereg_mr(self, mr: MrHandle) -> None:
        await self._client._call(Command.DEREG_MR, {"mr": mr.id})

    async def _submit(self, cmd: Command, body: dict[str, Any], payload: Sequence[Any] = (),
                      timeout: float | None = None) -> Completion:
        client = self._client
        if client._queued():
            await client.flush()
        if timeout is not None:
            body["timeout_ms"] = _ms(timeout)
        c = Completion(cmd.name)
        conn = client.conn
        seq = conn.send(cmd, body, payload, flags=Flag.NO_REPLY)
        c._origin = (client, seq)
        self._events.waiting[seq] = c
        await conn.drain()
        return c

    async def submit_single_write(
        self, length: int, imm: int | None, src: tuple[MrHandle, int],
        dst: tuple[MrDesc, int], *, timeout: float | None = None, wid: int | None = None,
        verify: bool | None = None, traceparent: str | None = None,
    ) -> Completion:
        """``wid``: a write id of your choosing (u64); a retry with the same one after a
        TIMEOUT is applied and counted at most once (docs/engine.md, write ids).
        ``verify``: a CRC32C per part, checked where it lands (None: the daemon's
        engine.verify); ``traceparent``: a W3C trace context (None: the current
        OpenTelemetry span's, where the ``otel`` extra is installed), docs/integrity.md."""
        body: dict[str, Any] = {"len": length, "imm": imm, "src": [src[0].id, src[1]],
                                "dst": [dst[0].to_wire(), dst[1]]}
        if wid is not None:
            body["wid"] = wid
        _tag(body, verify, traceparent)
        return await self._submit(Command.SINGLE_WRITE, body, timeout=timeout)

    async def submit_paged_writes(
        self, page_len: int, imm: int | None, src: tuple[MrHandle, Pages],
        dst: tuple[MrDesc, Pages], *, timeout: float | None = None, wid: int | None = None,
        verify: bool | None = None, traceparent: str | None = None,
    ) -> Completion:
        """``wid``, ``verify``, ``traceparent``: as for :meth:`submit_single_write`."""
        body: dict[str, Any] = {"page_len": page_len, "imm": imm,
                                "src": [src[0].id, src[1].to_wire()],
                                "dst": [dst[0].to_wire(), dst[1].to_wire()]}
        if wid is not None:
            body["wid"] = wid
        _tag(body, verify, traceparent)
        return await self._submit(Command.PAGED_WRITES, body, timeout=timeout)

    async def add_peer_group(self, addrs: Sequence[NetAddr]) -> PeerGroup:
        r = await self._client._call(Command.ADD_PEER_GROUP,
                                     {"addrs": [a.to_bytes() for a in addrs]})
        return PeerGroup(reply_uint(r, "group"), tuple(addrs))

    async def submit_scatter(
        self, group: PeerGroup | None, imm: int | None, src: MrHandle,
        dsts: Sequence[ScatterDst], *, timeout: float | None = None,
        verify: bool | None = None, traceparent: str | None = None,
    ) -> Completion:
        """``verify``, ``traceparent``: as for :meth:`submit_single_write`."""
        body: dict[str, Any] = {
            "group": group.id if group else None, "imm": imm, "mr": src.id,
            "dsts": [[d.len, d.src, d.dst[0].to_wire(), d.dst[1]] for d in dsts]}
        _tag(body, verify, traceparent)
        return await self._submit(Command.SCATTER, body, timeout=timeout)

    async def submit_barrier(
        self, group: PeerGroup | None, imm: int, dsts: Sequence[MrDesc],
        *, timeout: float | None = None, traceparent: str | None = None,
    ) -> Completion:
        """``traceparent``: as for :meth:`submit_single_write` (no bytes: no verify)."""
        body: dict[str, Any] = {"group": group.id if group else None, "imm": imm,
                                "dsts": [d.to_wire() for d in dsts]}
        _tag(body, None, traceparent)
        return await self._submit(Command.BARRIER, body, timeout=timeout)

    async def submit_send(self, addr: NetAddr, msg: Any, *, timeout: float | None = None,
                          traceparent: str | None = None) -> Completion:
        """``traceparent``: on the sending daemon's records of it (docs/integrity.md)."""
        # The payload is written to the socket (or copied) before this returns
        # control, so the caller may reuse ``msg`` at once.
        data = bytes(memoryview(msg).cast("B"))
        if COUNTING:
            count("client.send_message", len(data))
        body: dict[str, Any] = {"addr": addr.to_bytes()}
        _tag(body, None, traceparent)
        return await self._submit(Command.SEND, body, [data], timeout=timeout)

    def submit_recvs(self, length: int, count: int,
                     callback: MessageHandler | TracedMessageHandler, *,
                     traced: bool = False) -> None:
        """Post ``count`` receives of up to ``length`` bytes; ``callback(msg)`` per message
        (a ``length`` over the daemon's largest message, 1 MiB, takes every message that
        can come).  ``traced``: ``callback(msg, traceparent)``, the sender's W3C
        traceparent when its SEND carried one, else None (always None from a daemon
        before issue 20)."""
        body: dict[str, Any] = {"len": length, "count": count}
        if traced:
            body["trace"] = True
        seq = self._client.conn.send(Command.SUBMIT_RECVS, body, flags=Flag.NO_REPLY)
        self._events.receivers[seq] = callback  # type: ignore[assignment]
        if traced:
            self._events.traced.add(seq)

    async def expect_imm_count(
        self, imm: int, count: int, callback: Callable[[], None] | None = None,
        *, wait: bool | None = None, timeout: float | None = None,
    ) -> Completion:
        """Fires once immediate ``imm`` has counted ``count`` (which it then consumes).

        Without a callback this waits for it; with one (or ``wait=False``) it
        returns the Completion as soon as the daemon has registered it.
        ``timeout``: its deadline in seconds (the daemon's engine.expect_timeout_s
        when None); past it the Completion fails with ``Timeout``, nothing consumed.
        The callback runs only if it fired.
        """
        c = Completion(f"imm {imm} x{count}")
        body: dict[str, Any] = {"imm": imm, "count": count}
        if timeout is not None:
            body["timeout_ms"] = _ms(timeout)
        conn = self._client.conn
        r = conn.request(Command.EXPECT_IMM_COUNT, body)
        seq = conn.last_seq
        c._origin = (self._client, seq)
        self._events.waiting[seq] = c
        if callback is not None:
            c.add_done_callback(if_reached(callback))
        await registered(r, c, self._events, seq)
        if wait if wait is not None else callback is None:
            await c
        return c

    async def imm_count(self, imm: int) -> int:
        """The current, unconsumed count of an immediate (for polling)."""
        return reply_uint(await self._client._call(Command.IMM_COUNT, {"imm": imm}), "value")
