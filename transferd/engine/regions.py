"""Registered memory regions and their rkeys.

A region is a buffer registered for remote writes.  Each rail gets its own
64-bit rkey from ``secrets`` (unguessable); a remote write must present the
rkey of the rail it arrived on and stay inside the region, and is checked
before any byte is written.  Deregistration removes the rkeys, so a write
that presents one afterwards is refused.

A region's access rights (``"w"``, the default: peers may write; ``"r"``: peers
may read; ``"rw"``: both) are part of what its rkeys mean: :meth:`RegionTable.
by_rkey` opens a region only for a right it was registered with, and refuses
any other exactly as it refuses an unknown rkey (NOT_FOUND, the same message),
so a peer learns nothing about which regions exist.  Reads are admitted and
drained like writes: deregistration revokes both and waits for both.

A write is *admitted* (:meth:`Region.admit`) on the receiving worker after
those checks and before its first byte lands, and released once the bytes
landed or the write failed; while any is admitted the region keeps its
buffer's memory (a freed buffer's pages stay until its last write landed).
Deregistration stops admitting at once, and :meth:`Region.drained` resolves
when every admitted write has let go: DEREG_MR and FREE_BUFFER reply only
then, so no byte of a peer write lands in memory its owner got back.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from transferd.memory import Buffer, Ref
from transferd.protocol.errors import BadRequest, NotFound, OutOfBounds, OutOfMemory


@dataclass(eq=False)
class Region:
    id: int
    buffer: Buffer
    ptr: int
    size: int
    rkeys: tuple[int, ...]
    # What peers may do through the rkeys: "w", "r" or "rw" (see the module doc).
    access: str = "w"
    _admitted: int = field(default=0, repr=False)
    _closed: bool = field(default=False, repr=False)
    _drained: Future[None] = field(default_factory=Future, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # How to cut short each admitted write that said how (its link's close).
    _aborts: dict[int, Callable[[], None]] = field(default_factory=dict, repr=False)
    _tickets: Iterator[int] = field(default_factory=itertools.count, repr=False)
    # The buffer's memory, held while writes are admitted (see admit).
    _hold: Ref | None = field(default=None, repr=False)
    # Its staging path (device memory), found once: a buffer's memory does not change.
    staging: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.staging = self.buffer.staging

    # -- what a Domain may read (transferd.parts.RegionInfo) ------------------------------

    @property
    def device(self) -> str:
        return self.buffer.device

    def device_address(self, offset: int, size: int) -> int:
        """The device address of ``[offset, offset + size)`` of device memory."""
        return self.buffer.device_address(offset, size)

    # -- writes in flight -------------------------------------------------------------

    def admit(self, abort: Callable[[], None] | None = None) -> Admitted:
        """Let one inbound write land; NotFound once the region is deregistered.

        Called on the receiving worker after the rkey and bounds checks and
        before any byte lands.  Release what it returns once the bytes landed or
        the write failed (from any thread).  ``abort`` (callable from any thread)
        cuts the write short, so that no more of it lands and it is released:
        what :meth:`abort_admitted` calls for a write that never finishes (a
        peer that stalls mid-payload).

        While any write is admitted the region holds its buffer's memory (one
        Ref, taken by the first and let go once the region is deregistered and
        drained), so a buffer freed meanwhile keeps its pages until the last
        byte landed, without a Ref per write.
        """
        with self._lock:
            if self._closed:
                raise NotFound(f"region {self.id} was deregistered")
            if self._hold is None:
                self._hold = self.buffer.ref()  # NotFound once freed: nothing admitted
            self._admitted += 1
            ticket = -1
            if abort is not None:
                ticket = next(self._tickets)
                self._aborts[ticket] = abort
        return Admitted(self, ticket)

    def abort_admitted(self) -> int:
        """Cut short every admitted write that can be; returns how many were asked."""
        with self._lock:
            aborts = list(self._aborts.values())
        for fn in aborts:
            fn()
        return len(aborts)

    def _let_go(self, ticket: int) -> None:
        with self._lock:
            if ticket >= 0:
                self._aborts.pop(ticket, None)
            self._admitted -= 1
            done = self._closed and self._admitted == 0
            hold, self._hold = (self._hold, None) if done else (None, self._hold)
        if done:
            self._gone(hold)

    def _gone(self, hold: Ref | None) -> None:
        """Closed and drained: the buffer's memory may go, DEREG_MR may reply."""
        if hold is not None:
            hold.release()
        if not self._drained.done():
            self._drained.set_result(None)

    @property
    def admitted(self) -> int:
        """Writes admitted and not yet released."""
        return self._admitted

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Admit nothing more (RegionTable.deregister calls this)."""
        with self._lock:
            self._closed = True
            done = self._admitted == 0
            hold, self._hold = (self._hold, None) if done else (None, self._hold)
        if done:
            self._gone(hold)

    def drained(self) -> Future[None]:
        """Resolves (from any thread) once deregistered and every admitted write let go."""
        return self._drained

    def view(self, addr: int, length: int) -> memoryview:
        """Memory at absolute address ``addr``; bounds checked first."""
        off = addr - self.ptr
        if off < 0 or length < 0 or off + length > self.size:
            raise OutOfBounds(
                f"[0x{addr:x}, +{length}) is outside region {self.id} "
                f"[0x{self.ptr:x}, +{self.size})"
            )
        return self.buffer.view(off, length)

    def views(self, addrs: Sequence[int], length: int) -> list[memoryview]:
        """``length`` bytes at each absolute address, every one bounds checked.

        The same checks as :meth:`view` page by page, made once on the lowest
        and the highest address (a page list is thousands of entries).
        """
        if not addrs:
            return []
        lo, hi = min(addrs), max(addrs)
        if lo < self.ptr or length < 0 or hi - self.ptr + length > self.size:
            for a in addrs:  # name the first page that is out, as view() would
                self.view(a, length)
        ptr = self.ptr
        return self.buffer.views([a - ptr for a in addrs], length)

    def pages(self, offset: int, stride: int, indices: Sequence[int], length: int
              ) -> list[memoryview]:
        """``length`` bytes at ``offset + i * stride`` (from the region's start) for each
        index: :meth:`views` of those pages, their offsets computed once (a paged
        write's source)."""
        if not indices:
            return []
        offs = [offset + i * stride for i in indices]
        lo, hi = min(offs), max(offs)
        if lo < 0 or length < 0 or hi + length > self.size:
            ptr = self.ptr
            for o in offs:  # name the first page that is out, as view() would
                self.view(ptr + o, length)
        return self.buffer.views(offs, length)


class Admitted:
    """One admitted write's hold on its region: :meth:`release` once (any thread)."""

    __slots__ = ("_region", "_ticket")

    def __init__(self, region: Region, ticket: int) -> None:
        self._region: list[Region] = [region]
        self._ticket = ticket

    def release(self) -> None:
        try:
            region = self._region.pop()  # atomic: two threads release it once
        except IndexError:
            return
        region._let_go(self._ticket)

    @property
    def released(self) -> bool:
        return not self._region


ACCESS = ("w", "r", "rw")


def check_access(access: str) -> str:
    """``access`` as a region's rights (BadRequest for anything else)."""
    if access not in ACCESS:
        raise BadRequest(f"access {access!r} is not one of 'w' (peers write), 'r' (peers "
                         "read) or 'rw' (both)")
    return access


# Regions held at once unless told otherwise (engine.max_regions).
MAX_REGIONS = 65536


class RegionTable:
    def __init__(self, max_regions: int = MAX_REGIONS) -> None:
        # A region costs the daemon memory no limit charges, and REG_MR of one buffer
        # can be repeated: without a cap one client grew it without bound.
        self.max_regions = max_regions
        self._by_id: dict[int, Region] = {}
        self._by_rkey: dict[int, Region] = {}
        # Each buffer's regions (by id, in the order made): a freed buffer's are found
        # without a scan of every region, which made a connection closing with N
        # registered buffers cost the loop N x N (20,000: 14 s).
        self._by_buffer: dict[Buffer, dict[int, Region]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def register(self, buffer: Buffer, rails: int, access: str = "w") -> Region:
        check_access(access)
        with self._lock:
            if len(self._by_id) >= self.max_regions:
                raise OutOfMemory(f"{len(self._by_id)} regions registered: the most this "
                                  "daemon holds at once (engine.max_regions); deregister "
                                  "one (DEREG_MR) first")
            rkeys: list[int] = []
            while len(rkeys) < rails:
                k = secrets.randbits(64)
                if k and k not in self._by_rkey and k not in rkeys:
                    rkeys.append(k)
            region = Region(next(self._ids), buffer, buffer.address, buffer.size, tuple(rkeys),
                            access)
            self._by_id[region.id] = region
            self._by_buffer.setdefault(buffer, {})[region.id] = region
            for k in rkeys:
                self._by_rkey[k] = region
        return region

    def deregister(self, region_id: int) -> Region:
        with self._lock:
            region = self._by_id.pop(region_id, None)
            if region is None:
                raise NotFound(f"no registered region {region_id}")
            for k in region.rkeys:
                self._by_rkey.pop(k, None)
            mine = self._by_buffer.get(region.buffer)
            if mine is not None:
                mine.pop(region_id, None)
                if not mine:
                    del self._by_buffer[region.buffer]
        region.close()
        return region

    def get(self, region_id: int) -> Region:
        try:
            return self._by_id[region_id]
        except KeyError:
            raise NotFound(f"no registered region {region_id}") from None

    def by_rkey(self, rkey: int, rail: int, right: str = "w") -> Region:
        """The region an rkey opens for ``right`` ("w" or "r"), checked against the rail
        it came in on; a region without that right is refused as an unknown rkey is."""
        region = self._by_rkey.get(rkey)
        if region is None or rail >= len(region.rkeys) or region.rkeys[rail] != rkey \
                or right not in region.access:
            raise NotFound("rkey does not name a registered region on this rail")
        return region

    def snapshot(self) -> list[Region]:
        """Every region registered now (for listings: transferd buffers)."""
        with self._lock:
            return list(self._by_id.values())

    def regions_of(self, buffer: Buffer) -> list[Region]:
        with self._lock:
            return list(self._by_buffer.get(buffer, {}).values())

    def __len__(self) -> int:
        return len(self._by_id)
