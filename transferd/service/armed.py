"""Paged writes armed on a UVM watcher (ARM_PAGED_WRITES): the daemon fires them itself.

The article's pattern without the client in the loop: a kernel bumps a watched word
(a layer's KV is written), and the write of that layer's pages starts from the
watcher's delivery on the node's loop, not after an EVENT went to the client and its
PAGED_WRITES came back (about 300 us on one host, docs/benchmarks.md).

An arm is checked whole when it is made: everything PAGED_WRITES checks at submit
(the source region and its bounds, the destination's rails, bounds and trust, the
page counts, ``verify``/``traceparent``), so a bad one is refused then.  It fires at
most once, when the watcher sees its word at ``value`` or above (unsigned; two bumps
between polls are one change, so an exact match could be missed), or at once if the
word is there already, through :meth:`Service.submit_paged_writes` (the one path
every paged write takes); its end is that submit's, under the arm's key.  It is
dropped, never fired, when CANCEL names it (CANCELLED; also once fired while it
waits for room in its caller's share or the engine: nothing was sent), when its
watcher ends (its buffer freed: NOT_FOUND naming the watcher), or when its caller goes.  A source
region deregistered meanwhile fails the fire with the submit's own NOT_FOUND before
any byte is read; a destination gone fails at the peer as any write there does.

Bounded per caller (engine.max_armed_writes_per_connection, and the pages they hold,
engine.max_armed_pages_per_connection) and per watcher
(engine.max_armed_writes_per_watcher): one more is refused with OverLimit.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transferd.protocol.errors import (
    BadRequest,
    Internal,
    NotFound,
    OutOfBounds,
    OverLimit,
    TransferdError,
)
from transferd.protocol.values import MrDesc, Pages

from .caller import Caller
from .ops import Op

if TYPE_CHECKING:
    from transferd.engine import TransferEngine

    from .service import End, Service

U64 = (1 << 64) - 1


class ArmState(enum.Enum):
    ARMED = "armed"
    # Fired while its caller's share (engine.max_inflight_per_client) or the engine was
    # full: it waits for room, still in its caller's table, so a CANCEL drops it unsent.
    WAITING = "waiting"
    FIRED = "fired"
    DROPPED = "dropped"


@dataclass(frozen=True)
class PagedWrite:
    """A PAGED_WRITES request's fields, as the Service takes them."""

    page_len: int
    imm: int | None
    src: tuple[int, Pages]
    dst: tuple[MrDesc, Pages]
    verify: bool | None = None
    traceparent: str | None = None
    timeout: float | None = None


@dataclass(eq=False)
class Armed:
    caller: Caller
    key: int
    watcher: int
    value: int
    write: PagedWrite
    on_end: End = field(repr=False)
    op: Op | None = field(repr=False, default=None)
    state: ArmState = ArmState.ARMED

    @property
    def pages(self) -> int:
        return len(self.write.src[1].indices)


def check_paged_write(engine: TransferEngine, w: PagedWrite) -> None:
    """What the engine's submit_paged_writes checks before it sends, checked now and
    nothing sent: the typed error of the first thing wrong."""
    from transferd.engine.engine import _imm
    from transferd.engine.plan import plan_paged
    from transferd.protocol.integers import integer

    # The engine's own checks, the ones its submit starts with (trust of every rail of
    # the destination, the integrity tags): the same calls, not a second copy of them.
    engine._check_descs([w.dst[0]])
    engine._tag(w.verify, w.traceparent)
    imm = _imm(w.imm)  # an integer of 32 bits (or None), as the submit's
    integer(w.page_len, "a paged write's page length")
    region = engine.regions.get(w.src[0])
    sp = w.src[1]
    n = len(sp.indices)
    if n != len(w.dst[1].indices):
        raise BadRequest(f"{n} source pages for {len(w.dst[1].indices)} destination pages")
    if n:
        lo = region.ptr + sp.offset + min(sp.indices) * sp.stride
        hi = region.ptr + sp.offset + max(sp.indices) * sp.stride
        if lo < region.ptr or hi - region.ptr + w.page_len > region.size:
            bad = lo if lo < region.ptr else hi
            raise OutOfBounds(f"[0x{bad:x}, +{w.page_len}) is outside region {region.id} "
                              f"[0x{region.ptr:x}, +{region.size})")
    # The destination: rails, stride and every page inside the peer's region, as the
    # plan checks them (placeholder views: the plan only carries them).
    empty = memoryview(b"")
    plan_paged(0, w.page_len, imm, [empty] * n, w.dst[0], w.dst[1], engine.rails)


class ArmedWrites:
    """Every armed write of one node, by watcher and by caller (all on the node's loop)."""

    def __init__(self, service: Service, *, per_connection: int, per_watcher: int,
                 pages_per_connection: int, pages_total: int = 1 << 20) -> None:
        self._service = service
        self.per_connection = per_connection
        self.per_watcher = per_watcher
        self.pages_per_connection = pages_per_connection
        # All connections together: the per-connection bound times as many connections
        # as have a watcher (4096) was no bound (about 21 MiB each at the cap).
        self.pages_total = pages_total
        self._pages_total = 0
        self._by_watcher: dict[int, list[Armed]] = {}
        self._count: Counter[Hashable] = Counter()
        self._pages: Counter[Hashable] = Counter()
        self.fired = 0
        self.dropped = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_watcher.values())

    def watching(self, watcher_id: int) -> bool:
        return watcher_id in self._by_watcher

    def arm(self, caller: Caller, key: int, watcher_id: int, value: int, now: int,
            write: PagedWrite, on_end: End) -> Op:
        """Hold ``write`` until watcher ``watcher_id``'s word reaches ``value`` (``now``:
        the word as read at arm time; at or above ``value`` it fires on the loop's next
        turn).  Checked by the caller (:meth:`Service.arm_paged_writes`)."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U64:
            raise BadRequest(f"value {value!r} must be a 64-bit unsigned integer")
        armed_here = self._by_watcher.get(watcher_id, [])
        if len(armed_here) >= self.per_watcher:
            raise OverLimit(f"watcher {watcher_id} has {len(armed_here)} armed writes, the "
                            f"most one may hold (engine.max_armed_writes_per_watcher)")
        if self._count[caller] >= self.per_connection:
            raise OverLimit(f"this connection has {self._count[caller]} armed writes, the "
                            "most one may hold (engine.max_armed_writes_per_connection)")
        a = Armed(caller, key, watcher_id, value, write, on_end)
        if self._pages[caller] + a.pages > self.pages_per_connection:
            raise OverLimit(f"{a.pages} more armed pages would make this connection's "
                            f"{self._pages[caller] + a.pages}, over "
                            f"{self.pages_per_connection} (engine.max_armed_pages_per_connection)")
        if self._pages_total + a.pages > self.pages_total:
            raise OverLimit(f"{a.pages} more armed pages would make this daemon's "
                            f"{self._pages_total + a.pages}, all connections together, over "
                            f"{self.pages_total} (engine.max_armed_pages_total)")
        a.op = Op(key, f"ARM_PAGED_WRITES on watcher {watcher_id} at {value}",
                  lambda err: self._drop(a, err), with_caller=True)
        caller.ops.add(a.op, None)
        self._by_watcher.setdefault(watcher_id, []).append(a)
        self._count[caller] += 1
        self._pages[caller] += a.pages
        self._pages_total += a.pages
        if not self._still_there(watcher_id):
            # Its watcher ended since the caller looked it up (the watcher thread's sweep
            # of a freed buffer's word), before this arm was here for the sweep to find
            # (watchers_ended): nobody would ever drop it.  From here on the sweep does.
            self._forget(a, ArmState.DROPPED)
            caller.ops.finished(a.op, None)
            raise NotFound(f"watcher {watcher_id} ended (its buffer was freed): nothing "
                           "armed")
        if now >= value:
            asyncio.get_running_loop().call_soon(self._fire_if_armed, a)
        return a.op

    def _still_there(self, watcher_id: int) -> bool:
        watchers = self._service.watchers
        if watchers is None:
            return False
        try:
            watchers.get(watcher_id)
        except NotFound:
            return False
        return True

    # -- the watcher's side ----------------------------------------------------------

    def changed(self, watcher_id: int, new: int) -> None:
        """Watcher ``watcher_id``'s word reads ``new`` (on the loop): fire what it reached."""
        armed = self._by_watcher.get(watcher_id)
        if not armed:
            return
        for a in [a for a in armed if new >= a.value]:
            self._fire_if_armed(a)

    def watchers_ended(self, watcher_ids: list[int]) -> None:
        """Those watchers are gone: their armed writes are dropped, never fired."""
        for wid in watcher_ids:
            for a in list(self._by_watcher.get(wid, ())):
                if a.caller.closed:
                    self._drop(a, None)
                else:
                    assert a.op is not None
                    a.op.halt(NotFound(f"watcher {wid} ended (its buffer was freed) before its "
                                       f"word reached {a.value}: the armed write was "
                                       "dropped, nothing sent"))

    def caller_closed(self, caller: Caller) -> None:
        for armed in list(self._by_watcher.values()):
            for a in [a for a in armed if a.caller is caller]:
                self._drop(a, None)

    # -- ending one ------------------------------------------------------------------

    def _forget(self, a: Armed, state: ArmState) -> bool:
        """Take ``a`` out (once): False if it had already fired or been dropped."""
        if a.state is not ArmState.ARMED:
            return False
        a.state = state
        armed = self._by_watcher.get(a.watcher, [])
        if a in armed:
            armed.remove(a)
            if not armed:
                del self._by_watcher[a.watcher]
        self._count[a.caller] -= 1
        if self._count[a.caller] <= 0:
            del self._count[a.caller]
        self._pages[a.caller] -= a.pages
        if self._pages[a.caller] <= 0:
            del self._pages[a.caller]
        self._pages_total -= a.pages
        return True

    def _drop(self, a: Armed, err: TransferdError | None) -> bool:
        """Never sent: ``err`` is its end (None: its caller is gone, nobody to tell)."""
        if a.state is ArmState.WAITING:
            # Its wait for room runs on and finds it dropped (cancelling it would cancel
            # the caller's room future, which other submits wait on too).
            a.state = ArmState.DROPPED
        elif not self._forget(a, ArmState.DROPPED):
            return False
        self.dropped += 1
        assert a.op is not None
        a.caller.ops.finished(a.op, err)
        if err is not None and not a.caller.closed:
            a.on_end(err)
        return True

    def _fire_if_armed(self, a: Armed) -> None:
        if a.caller.closed:
            self._drop(a, None)
            return
        if not self._forget(a, ArmState.FIRED):
            return
        self.fired += 1
        self._start(a)

    def _start(self, a: Armed) -> None:
        """Submit the fired write; while its caller's share or the engine is full, wait
        for room first, the arm's op still in its caller's table (the submit's own wait
        would leave nothing there for a CANCEL to find, and send it later all the same)."""
        service = self._service
        engine = service.engine
        assert engine is not None and a.op is not None  # armed: the engine checked it
        if (len(a.caller.pending) >= engine.config.max_inflight_per_client
                or not engine.has_slot()):
            a.state = ArmState.WAITING
            task = asyncio.ensure_future(self._room(a.caller, engine))
            service.background.add(task)
            task.add_done_callback(lambda t: self._roomed(a, t))
            return
        a.state = ArmState.FIRED
        # The arm's op ends here; the submit's, under the same key, replaces it (a
        # CANCEL from now on names the write under way).
        a.caller.ops.finished(a.op, None)
        w = a.write
        try:
            admitted: Any = self._service.submit_paged_writes(
                a.caller, a.key, w.page_len, w.imm, w.src, w.dst, timeout=w.timeout,
                on_end=a.on_end, verify=w.verify, traceparent=w.traceparent)
        except TransferdError as err:  # what changed since the arm: a region deregistered
            self._failed(a, err)
            return
        if not isinstance(admitted, Op):  # the engine's slots are full: it waits for one
            task = asyncio.ensure_future(admitted)
            self._service.background.add(task)
            task.add_done_callback(lambda t: self._admitted_late(a, t))

    @staticmethod
    async def _room(caller: Caller, engine: TransferEngine) -> None:
        await caller.wait_room(engine.config.max_inflight_per_client)
        await engine.wait_slot()

    def _roomed(self, a: Armed, task: asyncio.Future[None]) -> None:
        self._service.background.discard(task)
        if a.state is not ArmState.WAITING or task.cancelled():
            return  # dropped meanwhile (CANCEL): it ended there
        exc = task.exception()
        if exc is not None:
            self._drop(a, exc if isinstance(exc, TransferdError) else Internal(repr(exc)))
        elif a.caller.closed:
            self._drop(a, None)
        else:
            self._start(a)  # room now (or wait again: another took it first)

    def _admitted_late(self, a: Armed, task: asyncio.Future[Any]) -> None:
        self._service.background.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, TransferdError):
            self._failed(a, exc)

    def _failed(self, a: Armed, err: TransferdError) -> None:
        self._service.metrics.error(err.code)
        if not a.caller.closed:
            a.on_end(err)

