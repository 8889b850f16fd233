"""The one interface through which every caller reaches one node's engine, buffers and owners.

Two kinds of caller use it: the RPC server (``rpc_server``: a handler parses a
frame, calls the method here, and writes what it returns as a reply or an EVENT)
and the inproc client (``client.inproc``: the engine in the caller's own process,
``Client.connect("inproc://")``), which calls the same methods with the same values.
So an operation added here (and to the engine) reaches both; neither has a second
copy of what an operation checks, whom it charges, or how it ends.

Conventions, the same for every method:

- ``caller`` is the :class:`~.caller.Caller` asking: the owner of what it makes,
  and the table of its pending operations.
- An operation that ends later (a submit, an expectation) takes ``key`` (the
  caller's name for it: an RPC request's seq, an inproc client's count) and
  ``on_end(error)``: called exactly once, on the node's loop, with None (done) or
  the TransferdError it ended with (failed, TIMEOUT at its deadline, CANCELLED).
  It returns the operation's :class:`~.ops.Op` (``cancel(caller, key)`` ends it
  early), or, when the engine's slots are all taken, an awaitable of it.
- A method that must wait (for writes admitted into memory being freed) returns
  an awaitable, else None: the work is done.
- Bad arguments raise the typed error (transferd.protocol.errors) before anything
  is touched; the node serves everybody else on.

Adding an operation: a method here (checks, then the engine's call through
:meth:`Service.submit` if it ends later), a handler in rpc_server that parses its
frame and calls it, and the Client method that asks for it (client/engine.py for
the wire, client/inproc.py in process).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from transferd import __version__
from transferd.memory import memory_class
from transferd.memory.leases import Lease, LeaseTable
from transferd.protocol.constants import Command
from transferd.protocol.errors import (
    BadRequest,
    Cancelled,
    NotFound,
    OverLimit,
    TransferdError,
    UnknownCommand,
)
from transferd.protocol.integers import integer, unsigned
from transferd.protocol.messages import Tensor
from transferd.protocol.trace import format as trace_text
from transferd.protocol.values import MrDesc, NetAddr, Pages, ScatterDst

from . import tensors
from .caller import Caller, CallerState
from .ops import Op, deadline
from .owners import resolve_owner, wait_drained

if TYPE_CHECKING:
    from transferd.config import Config
    from transferd.discovery.service import Discovery
    from transferd.engine import TransferEngine
    from transferd.engine.regions import Region
    from transferd.engine.watchers import Watcher, Watchers
    from transferd.memory import Buffer, BufferTable
    from transferd.memory.base import Memory
    from transferd.metrics import Metrics

    from .armed import ArmedWrites, PagedWrite
    from .names import Names

log = logging.getLogger("transferd.session")

End = Callable[[TransferdError | None], None]
# A submit's Op, or (the engine's slots all taken) an awaitable of it.
Admitted = Op | Awaitable[Op]
# A posted receive's delivery: (sender's (node, group), message) -> whether the caller
# took it all now (the sender's ACK goes at once) or the engine must wait for
# Service.drained(caller).
# (A post made ``traced`` is called with a third argument: the message's traceparent
# text, or None when its SEND carried none.)
Arrived = Callable[..., bool]

U32 = 0xFFFFFFFF
U64 = 0xFFFFFFFFFFFFFFFF


class Service:
    """One node's buffers, engine, owners, leases, watchers and names, for its callers."""

    def __init__(self, config: Config, buffers: BufferTable, metrics: Metrics, *,
                 engine: TransferEngine | None = None,
                 discovery: Discovery | None = None,
                 name: str = f"transferd/{__version__}") -> None:
        self.config = config
        # What this node says it is (HELLO's server, an embedded directory's record).
        self.name = name
        self.buffers = buffers
        self.metrics = metrics
        self.engine = engine
        # The owner of a buffer whose allocation names none: "daemon" or "connection".
        self.default_owner = config.memory.default_owner
        # Made on the loop (start()): their timers and threads are its.
        self.leases: LeaseTable | None = None
        self.watchers: Watchers | None = None
        self.armed: ArmedWrites | None = None
        self._discovery = discovery
        self._names: Names | None = None
        # Releases of a gone owner's buffers still waiting for admitted writes to land:
        # held here, so the loop's weak hold does not lose them.
        self.background: set[asyncio.Future[Any]] = set()

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Make the tables that live on the loop: leases (their timers), watchers."""
        from transferd.engine.watchers import Watchers

        m, e = self.config.memory, self.config.engine
        self.leases = LeaseTable(
            asyncio.get_running_loop(), self._lease_expired,
            max_leases=m.max_leases, max_per_connection=m.max_leases_per_connection,
            max_per_source=m.max_leases_per_source, max_ttl_s=m.max_lease_ttl_s)
        self.metrics.leases.set_function(self.leases.__len__)
        from .armed import ArmedWrites

        self.armed = armed = ArmedWrites(
            self, per_connection=e.max_armed_writes_per_connection,
            per_watcher=e.max_armed_writes_per_watcher,
            pages_per_connection=e.max_armed_pages_per_connection,
            pages_total=e.max_armed_pages_total)
        loop = asyncio.get_running_loop()

        def watchers_ended(gone: list[Watcher]) -> None:  # any thread
            ids = [w.id for w in gone if armed.watching(w.id)]
            if ids:
                with contextlib.suppress(RuntimeError):  # the node's loop is gone
                    loop.call_soon_threadsafe(armed.watchers_ended, ids)

        self.watchers = Watchers(alive=_alive, idle_poll_s=e.watcher_idle_poll_ms / 1000.0,
                                 max_watchers=e.max_watchers,
                                 max_per_owner=e.max_watchers_per_connection,
                                 ended=watchers_ended)
        self.metrics.registry.register(self.watchers)

    def close(self) -> None:
        """No lease timer or watcher outlives the node's front ends."""
        if self.leases is not None:
            self.leases.close()
        if self.watchers is not None:
            with contextlib.suppress(Exception):
                self.metrics.registry.unregister(self.watchers)
            self.watchers.close()

    def closed(self, caller: Caller) -> None:
        """``caller`` is gone (cleanly or not): what it owned goes, what it waited on ends.

        Its buffers are freed and their rkeys revoked (writes admitted into them finish
        landing first, in the background); its expectations, streams and posted
        receives end; leases it held stay, to run out unless another holder renews
        them; its watchers and word page go; its submits run on to their end.
        """
        caller.state = CallerState.CLOSED
        caller.ops.caller_closed()
        self.release_in_background(caller, f"connection {caller.peer} closed")
        if self.leases is not None:
            self.leases.connection_closed(caller)
        if self.armed is not None:
            self.armed.caller_closed(caller)
        if self.watchers is not None:
            self.watchers.owner_closed(caller)
        page, caller.word_page = caller.word_page, None
        if page is not None:
            page.close()
        if self.engine is not None:
            self.engine.session_closed(caller)

    def drained(self, caller: Caller) -> None:
        """``caller`` took everything it was handed (an RPC connection's write buffer
        emptied): the senders of the messages it was given get their ACKs."""
        if self.engine is not None:
            self.engine.session_drained(caller)

    @property
    def patience(self) -> float:
        """How long a release waits for a write in flight before cutting it short."""
        return self.engine.config.peer_timeout_s if self.engine is not None else 30.0

    # -- owners -----------------------------------------------------------------------

    def owner_for(self, caller: Caller, owner: str | None, lease: str | None,
                  default: str | None = None) -> Hashable | None:
        """The owner an allocation (or a published name) asks for, else ``default``
        (else memory.default_owner)."""
        return resolve_owner(caller, owner, lease, default or self.default_owner, self.leases)

    def release_owned(self, owner: Hashable) -> tuple[int, Awaitable[None] | None]:
        """Free every buffer ``owner`` holds and revoke their regions' rkeys, now.

        Returns how many buffers went, and an awaitable until the writes admitted
        into their regions before the revocation have landed (None: none in flight).
        """
        if self._names is not None:
            self._names.owner_gone(owner)
        table, engine = self.buffers, self.engine
        regions: list[Region] = []
        n = 0
        for buf in table.owned_by(owner):
            try:
                table.free_buffer(buf.id)
            except TransferdError:
                continue  # freed meanwhile
            n += 1
            if engine is not None:
                regions += engine.regions.regions_of(buf)
                # Writes in flight into it finish landing (they hold its memory).
                engine.buffer_freed(buf)
        return n, wait_drained(regions, self.patience)

    def release_in_background(self, owner: Hashable, why: str) -> int:
        """:meth:`release_owned` with nobody to answer: the drain runs on its own."""
        n, drained = self.release_owned(owner)
        if n:
            log.info("%s: %d buffer(s) freed", why, n)
        if drained is not None:
            task = asyncio.ensure_future(drained)
            self.background.add(task)
            task.add_done_callback(functools.partial(self._drained, why))
        return n

    def _drained(self, why: str, task: asyncio.Future[None]) -> None:
        self.background.discard(task)
        exc = task.exception() if not task.cancelled() else None
        if exc is not None:
            log.warning("%s: %s", why, exc)

    def _lease_expired(self, lease: Lease) -> None:
        self.metrics.leases_expired.inc()
        self.release_in_background(lease, f"lease {lease.name!r} expired unrenewed")

    # -- buffers ----------------------------------------------------------------------

    def devices(self) -> list[dict[str, Any]]:
        return self.buffers.device_info()

    def alloc_buffer(self, caller: Caller, device: str, size: int, *,
                     owner: str | None = None, lease: str | None = None) -> Buffer:
        """A new buffer on ``device``.  Its owner: ``owner`` / ``lease`` if named, else
        memory.default_owner; a shared (``shm``) buffer's is its caller's (the caller
        maps it) unless named."""
        table = self.buffers
        table.pool(device)  # an unknown device is NOT_FOUND before anything else
        shared = memory_class(device).needs_fd_passing
        got = self.owner_for(caller, owner, lease, "connection" if shared else None)
        buf = table.alloc(device, size, owner=got)
        buf.allocated_by = caller.peer
        return buf

    def adopt_memory(self, caller: Caller, device: str, size: int,
                     create: Callable[[], Memory], *, charge: int | None = None) -> Buffer:
        """A buffer over memory the caller brings (its CUDA allocation by IPC handle, its
        own array in process): owned by the caller, let go of (never freed by the
        node, unless ``create`` made it the node's) when it is freed or the caller goes.
        ``charge``: what it costs the device's limit (None: as a buffer of that size)."""
        buf = self.buffers.alloc(device, size, owner=caller, create=create, charge=charge)
        buf.allocated_by = caller.peer
        return buf

    def free_buffer(self, caller: Caller, buffer_id: int) -> Awaitable[None] | None:
        """Out of the table now, its regions' rkeys revoked; the awaitable ends once the
        writes admitted into them have landed (after it, no byte of a peer write lands
        in this memory)."""
        buf = self.buffers.free_buffer(buffer_id)
        engine = self.engine
        if engine is None:
            return None
        regions = engine.regions.regions_of(buf)
        engine.buffer_freed(buf)
        return wait_drained(regions, self.patience)

    def buffer_clear(self, caller: Caller, buffer_id: int, value: int
                     ) -> Awaitable[None] | None:
        return tensors.clear(self.buffers.get(buffer_id), value)

    def copy_tensor(self, caller: Caller, src: Tensor, dst: Tensor) -> Awaitable[None] | None:
        table = self.buffers
        return tensors.copy((table.get(src.buffer), src), (table.get(dst.buffer), dst))

    def set_tensor(self, caller: Caller, t: Tensor, data: memoryview) -> Awaitable[None] | None:
        """``data`` into ``t`` (a caller in this process: the RPC server's SETs land from
        the socket straight into the same views, by its sinks)."""
        return tensors.write(self.buffers.get(t.buffer), t, data)

    def get_tensor(self, caller: Caller, t: Tensor, out: memoryview) -> Awaitable[None] | None:
        """``t`` into ``out`` (a caller in this process; the RPC server sends from the view)."""
        return tensors.read(self.buffers.get(t.buffer), t, out)

    def synchronize(self, caller: Caller) -> Awaitable[None] | None:
        """Until every submit of ``caller`` started before has ended (their failures were
        reported through their own ``on_end``)."""
        if not caller.pending:
            return None

        async def wait() -> None:
            await asyncio.gather(*list(caller.pending), return_exceptions=True)

        return wait()

    # -- the engine: regions -------------------------------------------------------------

    def _engine(self) -> TransferEngine:
        if self.engine is None:
            raise UnknownCommand("this daemon runs without the transfer engine")
        return self.engine

    def main_address(self) -> NetAddr:
        return self._engine().main_address()

    def reg_mr(self, caller: Caller, buffer_id: int, access: str = "w"
               ) -> tuple[Region, MrDesc]:
        """A region of buffer ``buffer_id`` (host or device memory) and its MrDesc;
        ``access``: what peers may do through its rkeys ("w", "r", "rw")."""
        buf = self.buffers.get(buffer_id)
        return self._engine().reg_mr(buf, access)

    def dereg_mr(self, caller: Caller, mr: int) -> Awaitable[None] | None:
        """Revoke region ``mr``'s rkeys; the awaitable ends once the writes admitted into
        it before have landed (after it, no byte of a peer write lands there)."""
        engine = self._engine()
        region = engine.regions.get(mr)
        engine.dereg_mr(region.id)
        return wait_drained([region], self.patience)

    # -- the engine: submits -------------------------------------------------------------

    def submit(self, caller: Caller, key: int, label: str | int,
               start: Callable[[], asyncio.Future[None]], timeout: float | None,
               on_end: End, traceparent: str | None = None) -> Admitted:
        """Hand a checked submit to the engine (``start`` calls it); wait for a slot only
        when full: first this caller's own share (engine.max_inflight_per_client), then
        a slot of the engine shared by all (``traceparent``: the submit's, for its
        in-flight entry while it waits).

        Its deadline: ``timeout`` seconds if given (at most engine.peer_timeout_s, which
        bounds every transfer anyway); a write from device memory, whose staging wait
        comes before the transfer's own clock starts, gets twice engine.peer_timeout_s
        unless it names one.
        """
        engine, timeout, now = self._admit(caller, key, label, timeout)
        if now:
            return self._started(caller, key, label, start(), timeout, on_end, engine)

        async def later() -> Op:
            # Listed (transferd inflight) and stall-warned while it waits: queued. (Added
            # here, where the finally below is sure to run once it is.)
            from transferd.engine.inflight import Stage

            waiting = object()  # its key in the table: no engine op is made yet
            engine.inflight.add(waiting, _kind(label), owner=caller, stage=Stage.QUEUED,
                                trace=_trace_or_none(traceparent),
                                what=f"{_name(label)}, waiting for a slot "
                                     "(engine.max_inflight_per_client, engine slots)")
            try:
                await caller.wait_room(engine.config.max_inflight_per_client)
                await engine.wait_slot()
            finally:
                engine.inflight.remove(waiting)
            caller.ops.check_free(key)  # (an armed write of the key may have fired since)
            return self._started(caller, key, label, start(), timeout, on_end, engine)

        return later()

    def _admit(self, caller: Caller, key: int, label: str | int, timeout: float | None
               ) -> tuple[TransferEngine, float | None, bool]:
        """The engine, a submit's checked ``timeout``, and whether it starts now (its
        caller's share and the engine have room) or waits (:meth:`submit`); BadRequest
        while ``key`` names an operation of ``caller``'s still pending."""
        engine = self._engine()
        caller.ops.check_free(key)
        config = engine.config
        if timeout is not None:
            timeout = deadline(timeout, None, config.peer_timeout_s,
                               f"a {label if isinstance(label, str) else Command(label).name}",
                               "engine.peer_timeout_s")
        now = len(caller.pending) < config.max_inflight_per_client and engine.has_slot()
        return engine, timeout, now

    def _started(self, caller: Caller, key: int, label: str | int, fut: asyncio.Future[None],
                 timeout: float | None, on_end: End, engine: TransferEngine) -> Op:
        """A submit the engine took: in its caller's table until it ends."""
        caller.pending.add(fut)
        op = Op(key, label, functools.partial(engine.cancel, fut))
        if timeout is None and isinstance(fut, asyncio.Task):
            timeout = 2 * engine.config.peer_timeout_s  # staged first (see submit)
        caller.ops.add(op, timeout)
        done = functools.partial(self._completed, caller, op, on_end)
        if not engine.when_finished(fut, done):  # (called at its end, without a turn)
            fut.add_done_callback(done)
        return op

    def _completed(self, caller: Caller, op: Op, on_end: End, fut: asyncio.Future[None]
                   ) -> None:
        caller.finished_one(fut)
        err: TransferdError | None
        if fut.cancelled():  # a write from device memory stopped while staging: nothing sent
            err = op.reason or Cancelled(f"{op.what} was cancelled")
        else:
            exc = fut.exception()
            if exc is None or isinstance(exc, TransferdError):
                err = exc
            else:
                from transferd.protocol.errors import Internal

                err = Internal(repr(exc))
        caller.ops.finished(op, err)
        if err is not None:
            self.metrics.error(err.code)
        on_end(err)

    # One-sided reads (transferd/engine/reads.py): submits like the writes.

    def submit_single_read(self, caller: Caller, key: int, length: int,
                           dst: tuple[int, int], src: tuple[MrDesc, int], *,
                           timeout: float | None = None, on_end: End,
                           verify: bool | None = None, traceparent: str | None = None
                           ) -> Admitted:
        """``length`` bytes of the peer region ``src = (desc, offset)`` into our region
        ``dst = (mr, offset)``; done once every byte is in place.  ``caller`` is its
        owner (inflight); ``verify``, ``traceparent``: as a write's (docs/integrity.md)."""
        engine = self._engine()
        return self.submit(caller, key, Command.SINGLE_READ, lambda: engine.submit_single_read(
            length, dst, src, caller, verify=verify, traceparent=traceparent), timeout, on_end,
            traceparent)

    def submit_paged_reads(self, caller: Caller, key: int, page_len: int,
                           dst: tuple[int, Pages], src: tuple[MrDesc, Pages], *,
                           timeout: float | None = None, on_end: End,
                           verify: bool | None = None, traceparent: str | None = None
                           ) -> Admitted:
        engine = self._engine()
        few_pages(engine, dst[1], "PAGED_READS")
        few_pages(engine, src[1], "PAGED_READS")
        return self.submit(caller, key, Command.PAGED_READS, lambda: engine.submit_paged_reads(
            page_len, dst, src, caller, verify=verify, traceparent=traceparent), timeout,
            on_end, traceparent)

    def submit_gather(self, caller: Caller, key: int, mr: int,
                      srcs: Sequence[tuple[int, int, MrDesc, int]], *,
                      timeout: float | None = None, on_end: End,
                      verify: bool | None = None, traceparent: str | None = None
                      ) -> Admitted:
        engine = self._engine()
        few_enough(engine, srcs, "GATHER", "sources")
        return self.submit(caller, key, Command.GATHER, lambda: engine.submit_gather(
            mr, srcs, caller, verify=verify, traceparent=traceparent), timeout, on_end,
            traceparent)

    def submit_single_write(self, caller: Caller, key: int, length: int, imm: int | None,
                            src: tuple[int, int], dst: tuple[MrDesc, int], *,
                            wid: int | None = None, timeout: float | None = None,
                            on_end: End, verify: bool | None = None,
                            traceparent: str | None = None) -> Admitted:
        """``length`` bytes from region ``src = (mr, offset)`` to ``dst = (desc,
        offset)``; ``imm`` counted once at the destination once they are in place.
        ``wid``: a write id of ``caller``'s (ids are per caller: two callers' equal ids
        are two writes).  ``verify``: a CRC32C per part (None: engine.verify);
        ``traceparent``: a W3C trace context (docs/integrity.md)."""
        if type(length) is not int or type(src[1]) is not int or type(dst[1]) is not int:
            # (An inproc caller's: the wire's are decoded as integers. Tested at once,
            # without three calls on every small write's path.)
            length = integer(length, "a write's length")
            src = (src[0], integer(src[1], "a write's source offset"))
            dst = (dst[0], integer(dst[1], "a write's destination offset"))
        engine, timeout, now = self._admit(caller, key, Command.SINGLE_WRITE, timeout)
        if now:  # the usual case, without a closure: every small write's path
            return self._started(caller, key, Command.SINGLE_WRITE, engine.submit_single_write(
                length, imm, src, dst, wid, caller, verify=verify, traceparent=traceparent),
                timeout, on_end, engine)
        return self.submit(caller, key, Command.SINGLE_WRITE, lambda: engine.submit_single_write(
            length, imm, src, dst, wid, caller, verify=verify, traceparent=traceparent),
            timeout, on_end, traceparent)

    def submit_paged_writes(self, caller: Caller, key: int, page_len: int, imm: int | None,
                            src: tuple[int, Pages], dst: tuple[MrDesc, Pages], *,
                            wid: int | None = None, timeout: float | None = None,
                            on_end: End, verify: bool | None = None,
                            traceparent: str | None = None) -> Admitted:
        engine = self._engine()
        few_pages(engine, src[1], "PAGED_WRITES")
        few_pages(engine, dst[1], "PAGED_WRITES")
        page_len = integer(page_len, "a paged write's page length")
        return self.submit(caller, key, Command.PAGED_WRITES, lambda: engine.submit_paged_writes(
            page_len, imm, src, dst, wid, caller, verify=verify, traceparent=traceparent),
            timeout, on_end, traceparent)

    def submit_scatter(self, caller: Caller, key: int, group: int | None, imm: int | None,
                       mr: int, dsts: Sequence[ScatterDst], *, timeout: float | None = None,
                       on_end: End, verify: bool | None = None,
                       traceparent: str | None = None) -> Admitted:
        engine = self._engine()
        few_enough(engine, dsts, "SCATTER")
        for d in dsts:  # (an inproc caller's: the wire's are decoded as integers)
            if type(d.len) is not int or type(d.src) is not int or type(d.dst[1]) is not int:
                dsts = [ScatterDst(integer(d.len, "a scatter's length"),
                                   integer(d.src, "a scatter's source offset"),
                                   (d.dst[0], integer(d.dst[1], "a scatter's destination "
                                                                 "offset"))) for d in dsts]
                break
        return self.submit(caller, key, Command.SCATTER, lambda: engine.submit_scatter(
            group, imm, mr, dsts, caller, verify=verify, traceparent=traceparent),
            timeout, on_end, traceparent)

    def submit_barrier(self, caller: Caller, key: int, group: int | None, imm: int,
                       dsts: Sequence[MrDesc], *, timeout: float | None = None,
                       on_end: End, traceparent: str | None = None) -> Admitted:
        engine = self._engine()
        few_enough(engine, dsts, "BARRIER")
        return self.submit(caller, key, Command.BARRIER, lambda: engine.submit_barrier(
            group, imm, dsts, caller, traceparent=traceparent), timeout, on_end, traceparent)

    def submit_send(self, caller: Caller, key: int, addr: NetAddr, msg: bytes, *,
                    timeout: float | None = None, on_end: End,
                    traceparent: str | None = None) -> Admitted:
        """``msg`` (at most 1 MiB, copied now: the caller may reuse its buffer) to a
        receive posted at ``addr``."""
        engine = self._engine()
        return self.submit(caller, key, Command.SEND, lambda: engine.submit_send(
            addr, msg, caller, traceparent=traceparent), timeout, on_end, traceparent)

    def inflight(self) -> dict[str, Any] | None:
        """What is in flight now (engine/inflight.py), or None without an engine."""
        return self.engine.inflight.listing() if self.engine is not None else None

    def add_peer_group(self, caller: Caller, addrs: Sequence[NetAddr]) -> int:
        """A peer group, its links opened now; it goes with ``caller``."""
        if not addrs:
            raise BadRequest("a peer group needs at least one NetAddr")
        return self._engine().add_peer_group(addrs, caller)

    def submit_recvs(self, caller: Caller, length: int, count: int, arrived: Arrived, *,
                     traced: bool = False) -> None:
        """Post ``count`` receives of up to ``length`` bytes (engine/receives.py: a
        ``length`` over the largest message this daemon accepts, 1 MiB, is clamped to
        it).  ``traced``: ``arrived(peer, msg, traceparent)``, the sender's W3C
        traceparent (text) when its SEND carried one, else None."""
        engine = self._engine()
        # Unsigned 64-bit integers, as the wire's fields are (an inproc caller's too).
        length = unsigned(length, "submit_recvs' length", U64)
        count = unsigned(count, "submit_recvs' count", U64)
        if not traced:
            engine.submit_recvs(caller, length, count, arrived)
            return

        def with_trace(peer: tuple[int, int], msg: bytes, trace: bytes | None) -> bool:
            text = None
            if trace is not None:
                # (26 bytes a peer sent: one that is not a valid traceparent is not passed on.)
                with contextlib.suppress(BadRequest):
                    text = trace_text(trace)
            return arrived(peer, msg, text)

        engine.submit_recvs(caller, length, count, with_trace, traced=True)

    # -- the engine: counts ------------------------------------------------------------

    def expect_imm_count(self, caller: Caller, key: int, imm: int, count: int, *,
                         timeout: float | None = None, on_end: End) -> Op:
        """``on_end(None)`` once immediate ``imm`` reached ``count`` (then consumed); past
        its deadline (engine.expect_timeout_s unless given) ``on_end(Timeout)``, nothing
        consumed.  It ends with its caller."""
        engine = self._engine()
        try:
            imm, count = unsigned(imm, "imm", U32), unsigned(count, "count", U32)
        except BadRequest:
            raise BadRequest(f"imm {imm!r} and count {count!r} must be 32-bit unsigned "
                             "values") from None
        cfg = engine.config
        timeout = deadline(timeout, cfg.expect_timeout_s, cfg.max_expect_timeout_s,
                           "an EXPECT_IMM_COUNT", "engine.max_expect_timeout_s")
        ops = caller.ops
        ops.check_free(key)

        def reached() -> None:
            ops.finished(op, None)
            on_end(None)

        def stop(err: TransferdError) -> bool:
            # Dropped before it fired: nothing of the count is consumed.
            if not engine.cancel_expectation(caller, handle):
                return False
            ops.finished(op, err)
            on_end(err)
            return True

        # Fires at the earliest on the loop's next turn, after op exists.
        handle = engine.expect_imm_count(caller, imm, count, reached)
        op = ops.add(Op(key, f"EXPECT_IMM_COUNT of {count} on {imm}", stop, with_caller=True),
                     timeout)
        return op

    def imm_count(self, imm: int) -> int:
        return self._engine().imm_value(imm)

    # -- ending one early --------------------------------------------------------------------

    def cancel(self, caller: Caller, key: int) -> bool | Awaitable[bool]:
        """End ``caller``'s pending operation ``key`` with CANCELLED: True if that is how it
        ended, False if it had ended first; an awaitable of that while its end is on its
        way (a transfer ends as soon as its worker sees the cancel).  NotFound: no such
        operation of this caller (never started, already ended)."""
        op = caller.ops.get(key)
        if op is None:
            raise NotFound(f"no pending operation with seq {key} on this connection (never "
                           "sent here, already ended, or one CANCEL does not end)")
        op.halt(Cancelled(f"{op.what} (seq {key}) cancelled by the client"))
        if op.ended:
            return op.cancelled_by_us

        async def after() -> bool:
            await op.wait_ended()
            return op.cancelled_by_us

        return after()

    # -- leases ------------------------------------------------------------------------------

    def _leases(self) -> LeaseTable:
        if self.leases is None:  # pragma: no cover - start() makes it
            raise UnknownCommand("this daemon serves no leases")
        return self.leases

    def renew_lease(self, caller: Caller, name: str, ttl: float, *, join: bool = False
                    ) -> tuple[Lease, bool, int]:
        """Make lease ``name`` (True) or renew it (False) for ``ttl`` seconds from now;
        with how many buffers it owns.  Another caller's is refused unless ``join``."""
        got, created = self._leases().renew(name, ttl, caller, join=join, source=caller.source)
        return got, created, len(self.buffers.owned_by(got))

    def end_lease(self, caller: Caller, name: str, *, join: bool = False
                  ) -> tuple[int, Awaitable[None] | None]:
        """End lease ``name`` now: its buffers freed (how many), the awaitable until the
        writes admitted into their regions have landed."""
        ended = self._leases().end(name, caller, join=join)
        return self.release_owned(ended)

    # -- watchers ----------------------------------------------------------------------------

    def alloc_uvm_watcher(self, caller: Caller, changed: Callable[[Watcher, int, int], None],
                          buffer_id: int | None = None, offset: int = 0
                          ) -> tuple[Watcher, dict[str, Any]]:
        """A 64-bit word watched for ``caller``: in its word page (made on first use: a
        file in /dev/shm, mode 0600, removed when the caller goes) or, with
        ``buffer_id``, the 8-byte aligned word at ``offset`` of that buffer (which must
        have a host view).  ``changed(watcher, old, new)`` runs on the node's loop for
        every change the watcher thread sees; the next is handed on only once the
        caller called ``watcher.delivered()`` (changes seen meanwhile are merged).
        Returns the watcher and where its word is (``path``, ``offset``, ``page_size``
        for a page word)."""
        from transferd.engine.watchers import WORD, WordPage, buffer_words

        from .caller_memory import _pin_arrays

        watchers = self.watchers
        assert watchers is not None, "start() makes the watcher set"
        loop = asyncio.get_running_loop()
        where: dict[str, Any] = {}
        keep: Any
        gone: Any
        watchers.check_room(caller)  # before a word of the page is taken
        offset = integer(offset, "a watcher's offset")
        if buffer_id is not None:
            buffer_id = integer(buffer_id, "a watcher's buffer")
            buf = self.buffers.get(buffer_id)
            if buf.staging is not None:
                raise BadRequest(f"buffer {buf.id} has no host view to watch")
            view = buf.view(0, buf.size)
            # The view and, for a caller's numpy array, its pins (caller_memory.py): the
            # buffer's free lets go of the array's own, and the caller's resize would move
            # the data under the watcher thread before this watcher's sweep ended it.
            (words, index), keep = buffer_words(view, offset), (view, _pin_arrays(view.obj))
            key: Hashable = ("buffer", buf.id)
            # Ends once the buffer is freed: its view would hold the memory and the charge.
            gone = lambda: buf.freed
        else:
            page = caller.word_page
            if page is None or page.closed:
                try:
                    page = caller.word_page = WordPage()
                except OSError as exc:
                    raise BadRequest(f"cannot make a shared word page: {exc}") from None
            at = page.take()
            words, index, keep, key, gone = page.words, at // WORD, page, page, None
            where.update(path=str(page.path), offset=at, page_size=len(page.words) * 8)
        box: list[Watcher] = []
        armed = self.armed

        def deliver(old: int, new: int) -> None:
            if not caller.closed:
                w = box[0]
                if armed is not None and armed.watching(w.id):
                    armed.changed(w.id, new)  # first: the write goes before the EVENT
                changed(w, old, new)

        def on_thread(old: int, new: int) -> None:  # on the watcher thread
            with contextlib.suppress(RuntimeError):  # the node's loop is gone
                loop.call_soon_threadsafe(deliver, old, new)

        w = watchers.add(caller, key, words, index, on_thread, keep, handoff=True, gone=gone)
        box.append(w)
        return w, where

    def arm_paged_writes(self, caller: Caller, key: int, watcher_id: int, value: int,
                         write: PagedWrite, *, on_end: End) -> Op:
        """Hold paged write ``write`` until ``caller``'s watcher ``watcher_id`` sees its
        word at ``value`` or above, then submit it as :meth:`submit_paged_writes` does,
        under ``key``; ``on_end`` is that submit's end (or the arm's: dropped with its
        watcher, NOT_FOUND; cancelled, CANCELLED).  Checked whole now, as that submit
        checks it (service/armed.py)."""
        from .armed import check_paged_write

        engine = self._engine()
        few_pages(engine, write.src[1], "ARM_PAGED_WRITES")
        few_pages(engine, write.dst[1], "ARM_PAGED_WRITES")
        watchers, armed = self.watchers, self.armed
        assert watchers is not None and armed is not None, "start() makes them"
        try:
            w = watchers.get(watcher_id)
        except NotFound:
            w = None
        if w is None or w.owner is not caller:
            raise NotFound(f"no watcher {watcher_id} on this connection")
        caller.ops.check_free(key)
        if write.timeout is not None:
            # Its deadline's checks (the key's were made above).
            self._admit(caller, key, Command.PAGED_WRITES, write.timeout)
        check_paged_write(engine, write)
        return armed.arm(caller, key, watcher_id, value, w.read(), write, on_end)

    # -- names -------------------------------------------------------------------------------

    @property
    def names(self) -> Names:
        """The cluster's names through this node (transferd/service/names.py)."""
        if self._names is None:
            from .names import Names

            self._names = Names(self)
        return self._names

    @property
    def discovery(self) -> Discovery:
        """The node's Discovery; a node built without one gets an embedded one."""
        if self._discovery is None:
            from transferd.config_discovery import DiscoveryConfig
            from transferd.discovery.service import Discovery

            disc = self._discovery = Discovery(DiscoveryConfig())
            disc.directory.node_name = "local"
            disc.directory.record = {"v": 1, "name": "local", "server": self.name,
                                     "version": [1, self.config.server.protocol_minor, 0]}
        return self._discovery

    @property
    def has_discovery(self) -> bool:
        return self._discovery is not None

    # -- what a listing shows -------------------------------------------------------------

    def buffer_listing(self, viewer: Caller) -> dict[str, Any]:
        from transferd.inventory import buffer_listing

        return buffer_listing(self.buffers, self.engine, viewer=viewer)


_READS = frozenset({Command.SINGLE_READ, Command.PAGED_READS, Command.GATHER})


def _kind(label: str | int) -> str:
    """An in-flight entry's kind for a submit's command (as the engine names them)."""
    if label in _READS:
        return "read"
    return "send" if label == Command.SEND else "write"


def _name(label: str | int) -> str:
    return label if isinstance(label, str) else Command(label).name


def _trace_or_none(traceparent: str | None) -> bytes | None:
    """A waiting submit's trace id for its listing; a bad one is the engine's to refuse
    (with its message) when the submit starts."""
    if traceparent is None:
        return None
    from transferd.protocol import trace

    try:
        return trace.parse(traceparent)
    except BadRequest:
        return None


def _alive(owner: Hashable) -> bool:
    """Whether a watcher's owner is still there (the sweep ends those of gone callers)."""
    return not getattr(owner, "closed", False)


def few_enough(engine: TransferEngine, dsts: Sequence[Any], what: str,
               named: str = "destinations") -> None:
    """engine.max_scatter_dsts, for every caller (the wire's handler counts them before
    decoding one; an inproc caller's list is counted here): a SCATTER's or BARRIER's
    destinations, a GATHER's sources."""
    cap = engine.config.max_scatter_dsts
    if len(dsts) > cap:
        raise OverLimit(f"a {what} of {len(dsts)} {named} is over this daemon's cap "
                        f"of {cap} (engine.max_scatter_dsts): split it")


def few_pages(engine: TransferEngine, pages: Any, what: str) -> None:
    """engine.max_paged_pages, for every caller, on one side of a paged command:
    ``pages`` a Pages (an inproc caller's, counted here) or its wire form ``[indices,
    stride, offset]`` (the wire's handler counts it before one index is decoded; a form
    that is not one is left to Pages.from_wire to refuse)."""
    if isinstance(pages, Pages):
        indices: Any = pages.indices
    elif isinstance(pages, list | tuple) and pages:
        indices = pages[0]
    else:
        return
    cap = engine.config.max_paged_pages
    if isinstance(indices, list | tuple) and len(indices) > cap:
        raise OverLimit(f"a {what} of {len(indices)} pages is over this daemon's cap of "
                        f"{cap} (engine.max_paged_pages): split it")


