"""The engine's side of the port its domain groups land writes through.

A domain group knows no region and no counter (``transferd.domains`` imports nothing
of the engine): its landing rules (:mod:`transferd.protocol.peer_landing`) ask this
:class:`EnginePort` to check a write against the region its rkey opens and admit it
(:meth:`place`), and to count an immediate (:meth:`count`); messages and a sender's
end go to the engine's receives.

A region of host memory gives its pages' views; one of device memory (no host view,
a staging path) gives chunks of its group's pinned staging to receive into, then
copies them to the device and says when that completed (:class:`StagedPlacement`):
the write counts, and is acknowledged, only once its bytes are on the device.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Hashable
from typing import Any

from transferd.memory.staging import GatedLanding, release_after
from transferd.parts import Ack
from transferd.protocol import crc as crc32c
from transferd.protocol.errors import (
    BadRequest,
    OutOfBounds,
    OutOfMemory,
    TransferdError,
)

from .fair_pieces import PieceThread
from .immcounter import ImmCounter
from .regions import Admitted, Region, RegionTable

Done = Callable[[TransferdError | None], None]
# A peer's verified READ of host memory answers with the CRC32C of its bytes, taken on
# the link's loop before the first byte goes, up to this many bytes (our own readers
# ask in parts of 8 MiB, up to 512 MiB); a longer one's is taken on the port's checksum
# thread (one, so that a core is left to the loops; the CRC32C functions let go of the
# GIL) while the link reads nothing more, as a READ of device memory waits for its
# staging copy (ChecksummedSource): a peer's READ of a whole 4 GiB region held the
# daemon's loop 0.17 s per READ (more with a slower CRC32C), one per link it dialled.
# A link held so watches for its peer hanging up: then its checksum is not taken
# (abandon).
CRC_INLINE_MAX = 16 << 20
# A long checksum is taken this much at a time, in turn with other peers' READs
# (fair_pieces: one peer's READ of 4096 pages of 4000 MiB holds nobody else's behind
# it), and one whose link went meanwhile stops within a piece (a few ms), not at its end.
CRC_PIECE = 64 << 20
# The checksums that may wait for the thread, where the engine says no other bound
# (engine.max_links' default: a tcp link holds one such READ at a time).
MAX_CHECKSUMS = 4096
# deliver(peer, msg, ack, source, trace, op): the engine's receive side.
Deliver = Callable[[tuple[int, int], bytes, Ack, Hashable, "bytes | None", int], None]


class HostPlacement:
    """A write's pages in host memory, admitted until released."""

    __slots__ = ("_ref", "views")
    deferred = False
    crc = None  # (a READ's checksum is the link's to take)

    def __init__(self, views: list[memoryview], ref: Admitted) -> None:
        self.views = views
        self._ref = ref

    def land(self, done: Done) -> None:
        raise AssertionError("host memory: the bytes are in place once received")

    def release(self) -> None:
        self._ref.release()

    def abandon(self) -> None:
        self._ref.release()


class Turn(enum.Enum):
    """Where a ChecksummedSource's checksum is."""

    NEW = "new"  # land not called yet
    QUEUED = "queued"  # waiting for its next piece's turn on the port's thread
    TAKING = "taking"  # a piece of it on the thread now
    HANDED = "handed"  # its outcome given to ``done``: the link lets go of it
    DROPPED = "dropped"  # its link went while it waited: let go, nothing more taken
    LEFT = "left"  # its link went while a piece was taken: let go by the thread, once


class ChecksummedSource:
    """A peer's verified READ of host memory past CRC_INLINE_MAX: deferred as a READ of
    device memory is, its ``land`` taking the CRC32C of the pages on the port's
    checksum thread, a piece at a time in turn with other peers' (fair_pieces), before
    ``done``; then sent from the same views with :attr:`crc`.  Its link gone first
    (:meth:`abandon`), a checksum waiting is taken no further, one being taken stops
    at the end of its piece; either way it is let go once."""

    __slots__ = ("_done", "_inner", "_lane", "_lock", "_pos", "_thread", "_turn", "_value",
                 "crc")
    deferred = True

    def __init__(self, inner: HostPlacement, thread: PieceThread, lane: Hashable) -> None:
        self._inner = inner
        self._thread = thread
        self._lane = lane  # whose turn it waits for: the READ's peer
        self.crc: int | None = None
        self._turn = Turn.NEW
        self._done: Done | None = None
        self._value = 0  # the CRC32C so far, up to _pos (view, offset in it)
        self._pos = (0, 0)
        # (The link's loop abandons it while the checksum thread may be taking it.)
        self._lock = threading.Lock()

    @property
    def views(self) -> list[memoryview]:
        return self._inner.views

    @property
    def turn(self) -> Turn:
        return self._turn

    def land(self, done: Done) -> None:
        with self._lock:
            if self._turn is not Turn.NEW:
                return  # (abandoned before its link handed it on: nothing to take)
            self._turn = Turn.QUEUED
            self._done = done
        try:
            self._thread.submit(self._lane, self)
        except TransferdError:
            with self._lock:
                self._turn = Turn.HANDED  # (refused: the link lets go of it)
            raise

    def step(self) -> bool:
        """One piece (the checksum thread); True while there is more to take."""
        with self._lock:
            if self._turn is not Turn.QUEUED:
                return False  # (dropped while it waited: let go, nobody wants it)
            self._turn = Turn.TAKING
        err: TransferdError | None = None
        more = False
        try:
            more = self._piece()
        except TransferdError as exc:
            err = exc
        except Exception as exc:  # (a view let go under it: the answer is refused)
            err = BadRequest(f"the checksum of a READ's answer failed: {exc}")
        with self._lock:
            left = self._turn is Turn.LEFT
            if not left:
                if more and err is None:
                    self._turn = Turn.QUEUED  # (abandoned from now: dropped, not left)
                    return True
                self._turn = Turn.HANDED
        if left:
            self._inner.release()  # (its link is gone: nobody else will)
            return False
        if err is None:
            self.crc = self._value
        self._hand(err)
        return False

    def _piece(self) -> bool:
        """Continue the CRC32C over the next CRC_PIECE bytes of the views (several short
        pages in one piece: a piece's worth of work per turn, whatever the pages)."""
        views = self._inner.views
        i, off = self._pos
        want = CRC_PIECE
        piece: list[memoryview] = []
        while i < len(views) and want > 0:
            v = views[i]
            k = min(len(v) - off, want)
            if k > 0:
                piece.append(v if k == len(v) else v[off:off + k])
            off += k
            want -= k
            if off >= len(v):
                i, off = i + 1, 0
        self._value = crc32c.crc_of(piece, self._value)
        self._pos = (i, off)
        return i < len(views)

    def refuse(self, error: TransferdError) -> None:
        """The port closed while it waited (the checksum thread): answered ``error``."""
        with self._lock:
            if self._turn is not Turn.QUEUED:
                return  # (dropped: let go already)
            self._turn = Turn.HANDED
        self._hand(error)

    def _hand(self, error: TransferdError | None) -> None:
        done = self._done
        assert done is not None
        try:
            done(error)
        except RuntimeError:
            # Its link's loop is closed (the engine stopped): nobody will answer or
            # let go of this READ but here, once.
            self.release()

    def abandon(self) -> None:
        """Its link closed before it was answered (any time after it was made, from
        the link's loop): let go once, now unless a piece is being taken (then by the
        checksum thread once it stopped); ``done`` may come after, or not."""
        with self._lock:
            turn = self._turn
            if turn is Turn.TAKING:
                self._turn = Turn.LEFT
                return
            if turn is Turn.LEFT or turn is Turn.DROPPED:
                return
            self._turn = Turn.DROPPED
        if turn is Turn.QUEUED:
            self._thread.withdraw(self._lane, self)  # (its place is another's now)
        self._inner.release()

    def release(self) -> None:
        self._inner.release()


class Hold(enum.Enum):
    """Where a staged placement's or source's chunks and region admission are."""

    HELD = "held"  # its link's (to answer from, or land): let go by it, once
    ABANDONED = "abandoned"  # (a READ's) its link went: let go once its copies ended
    LET_GO = "let-go"  # chunks back (after their last copy), admission let go: once


def _report(done: Done, outcome: TransferdError | None, let_go: Callable[[], None]) -> None:
    """``done(outcome)`` from the event waiter's thread.  Its RuntimeError is the link's
    loop closed under it (the engine stopped: ``call_soon_threadsafe`` refused): nobody
    will answer it nor let go of its staging and admission but here (the waiter only
    logs a callback's error)."""
    try:
        done(outcome)
    except RuntimeError:
        let_go()


class StagedPlacement:
    """A write into device memory: received into staging chunks, copied to the device.

    The chunks come from the group's bounded pool, only those free now (a receiver
    cannot wait); the link reads nothing more until :meth:`land` said it is done.
    """

    __slots__ = ("_admitted", "_chunks", "_handed", "_hold", "_io", "_lock", "_pages",
                 "views")
    deferred = True
    crc = None  # (a write's: never asked)

    def __init__(self, io: Any, chunks: list[Any], pages: list[tuple[int, int]],
                 admitted: Admitted, nbytes: int) -> None:
        self._io = io
        self._chunks = chunks
        self._pages = pages
        self._admitted = admitted
        self._handed = 0  # chunks given to the copies (they go back to the pool after)
        self._hold = Hold.HELD
        # (Let go by the link's loop, or by the waiter's thread when that loop closed.)
        self._lock = threading.Lock()
        left, views = nbytes, []
        for c in chunks:
            k = min(left, c.size)
            views.append(c.view[:k])
            left -= k
        self.views = views

    def land(self, done: Done) -> None:
        """Every chunk's H2D copies, then ``done`` on the event waiter's thread: None, or
        the device's fault (a DeviceFault) when a copy failed."""
        io, chunks = self._io, self._chunks
        gate = GatedLanding(io)
        per_chunk: list[list[tuple[int, int, int]]] = [[] for _ in chunks]
        step = io.pool.chunk_size
        pos = 0
        for dev, n in self._pages:
            while n:
                ci, off = divmod(pos, step)
                k = min(n, step - off)
                per_chunk[ci].append((dev, off, k))
                dev, n, pos = dev + k, n - k, pos + k
        left = [len(chunks)]
        faults: list[TransferdError] = []

        def copied(fault: TransferdError | None) -> None:  # once per chunk, waiter's thread
            if fault is not None:
                faults.append(fault)
            left[0] -= 1
            if not left[0]:
                # A copy the device failed: nothing of this write counts (it fails).
                _report(done, faults[0] if faults else None, self.release)

        if not chunks:
            _report(done, None, self.release)
            return
        for chunk, pieces in zip(chunks, per_chunk, strict=True):
            self._handed += 1
            gate.land(chunk, pieces, copied)

    def release(self) -> None:
        with self._lock:
            if self._hold is Hold.LET_GO:
                return  # (a chunk given back twice would be two writers' at once)
            self._hold = Hold.LET_GO
            unused, self._chunks = self._chunks[self._handed:], self._chunks[:self._handed]
        # Chunks never handed to a copy (closed mid-payload) go back unused.
        for chunk in unused:
            self._io.pool.release(chunk)
        self._admitted.release()

    @property
    def hold(self) -> Hold:
        return self._hold


def _pieces(pages: list[tuple[int, int]], step: int, chunks: int
            ) -> list[list[tuple[int, int, int]]]:
    """Pages (device address, length), laid end to end over chunks of ``step`` bytes:
    per chunk, its (device address, offset in the chunk, length) pieces."""
    per_chunk: list[list[tuple[int, int, int]]] = [[] for _ in range(chunks)]
    pos = 0
    for dev, n in pages:
        while n:
            ci, off = divmod(pos, step)
            k = min(n, step - off)
            per_chunk[ci].append((dev, off, k))
            dev, n, pos = dev + k, n - k, pos + k
    return per_chunk


class StagedSource:
    """A peer's READ of device memory: copied device to host into staging chunks of the
    region's group (:meth:`land`), then sent from them (``views``); the chunks go back
    once the bytes were sent and the last copy on them ended (:meth:`release`)."""

    __slots__ = ("_admitted", "_chunks", "_fence", "_hold", "_io", "_lock", "_pages",
                 "views")
    deferred = True
    crc = None  # (taken by the link from the staging chunks)

    def __init__(self, io: Any, chunks: list[Any], pages: list[tuple[int, int]],
                 admitted: Admitted, nbytes: int) -> None:
        self._io = io
        self._chunks = chunks
        self._pages = pages
        self._admitted = admitted
        self._fence: Any = None
        self._hold = Hold.HELD
        # (Let go by the link's loop, by the waiter's thread once an abandoned one's
        # copies ended, or by it when the link's loop closed before its copies did.)
        self._lock = threading.Lock()
        left, views = nbytes, []
        for c in chunks:
            k = min(left, c.size)
            views.append(c.view[:k])
            left -= k
        self.views = views

    def land(self, done: Done) -> None:
        """The D2H copies into staging, then ``done`` (the waiter's thread): None, or the
        device's fault (nothing of it may be sent)."""
        io = self._io
        if self._hold is not Hold.HELD:
            return  # (its link closed before it was handed on: no copy for nobody)
        if not self._chunks:
            _report(done, None, self.release)
            return
        stream = io.stream
        for chunk, pieces in zip(self._chunks, _pieces(self._pages, io.pool.chunk_size,
                                                       len(self._chunks)), strict=True):
            for dev, off, n in pieces:
                stream.copy_d2h(chunk.ptr + off, dev, n)
        self._fence = event = stream.record()
        io.waiter.watch(event, lambda outcome: _report(done, outcome, self.release))

    def release(self) -> None:
        """Let go once (whoever comes first of the link, an abandon's watch on its copies
        and a ``done`` refused by a closed loop): its chunks back after its last copy."""
        with self._lock:
            if self._hold is Hold.LET_GO:
                return  # (a chunk given back twice would be two READs' at once)
            self._hold = Hold.LET_GO
            chunks, self._chunks = self._chunks, []
        release_after(self._io, chunks, self._fence)
        self._admitted.release()

    @property
    def hold(self) -> Hold:
        return self._hold

    def abandon(self) -> None:
        """Its link closed before it was answered (from the link's loop): let go once
        its copies ended (they read the region: its memory is held until then), at once
        if none was enqueued; ``done`` still comes, and is for nobody."""
        with self._lock:
            if self._hold is not Hold.HELD:
                return
            self._hold = Hold.ABANDONED
        fence = self._fence
        if fence is None or fence.outcome() is not False:
            self.release()
        else:
            self._io.waiter.watch(fence, lambda _outcome: self.release())


class EnginePort:
    """What the engine's domain groups land writes through (see the module doc)."""

    def __init__(self, regions: RegionTable, counter: ImmCounter, deliver: Deliver,
                 sender_gone: Callable[[Hashable], None], *,
                 max_checksums: int = MAX_CHECKSUMS) -> None:
        self.regions = regions
        self.counter = counter
        self._deliver = deliver
        self._sender_gone = sender_gone
        # Long READ checksums (ChecksummedSource), round-robin across their peers; a
        # thread only while one waits.  Bounded by the links (one such READ each: the
        # engine passes engine.max_links), refused past it (OutOfMemory).
        self.checksums = PieceThread(max_checksums)

    def close(self) -> None:
        """The engine stops: the checksum thread ends once the piece it is taking is
        done; none queued, nor asked for from now on, is taken (those READs are
        refused, PeerUnreachable)."""
        self.checksums.close()

    def place(self, rkey: int, rail: int, addrs: list[int], lens: list[int],
              payload_len: int, abort: Callable[[], None] | None
              ) -> HostPlacement | StagedPlacement:
        region = self.regions.by_rkey(rkey, rail, "w")
        io = region.staging
        if io is not None:
            return self._staged(region, io, addrs, lens, payload_len, abort)
        if len(addrs) == 1:
            views = [region.view(addrs[0], lens[0])]
            total = lens[0]
        elif lens and min(lens) == max(lens):
            # Pages of one length (a paged write): checked once on the lowest and highest.
            views = region.views(addrs, lens[0])
            total = lens[0] * len(views)
        else:
            views = [region.view(a, n) for a, n in zip(addrs, lens, strict=True)]
            total = sum(lens)
        if total != payload_len:
            raise BadRequest(f"pages hold {total} bytes but the payload has {payload_len}")
        return HostPlacement(views, region.admit(abort))

    def source(self, rkey: int, rail: int, addrs: list[int], lens: list[int],
               abort: Callable[[], None] | None, checksum: bool = False,
               peer: Hashable = None
               ) -> HostPlacement | StagedSource | ChecksummedSource:
        """A peer's READ: the region ``rkey`` opens for reading on ``rail`` (NotFound, as
        for an unknown rkey, when it was registered without "r"), every page inside it
        (OutOfBounds), admitted like a write until the bytes were sent (released).
        ``checksum`` past CRC_INLINE_MAX of host memory: its CRC32C taken here, off the
        link's loop (ChecksummedSource), in turn with other peers' READs (``peer``:
        the authenticated one asking; None: one lane for all that name none)."""
        region = self.regions.by_rkey(rkey, rail, "r")
        io = region.staging
        if io is not None:
            return self._staged_source(region, io, addrs, lens, abort)
        if len(addrs) == 1:
            views = [region.view(addrs[0], lens[0])]
        elif lens and min(lens) == max(lens):
            views = region.views(addrs, lens[0])
        else:
            views = [region.view(a, n) for a, n in zip(addrs, lens, strict=True)]
        src = HostPlacement(views, region.admit(abort))
        if checksum and sum(lens) > CRC_INLINE_MAX:
            return ChecksummedSource(src, self.checksums, peer)
        return src

    def _staged_source(self, region: Region, io: Any, addrs: list[int], lens: list[int],
                       abort: Callable[[], None] | None) -> StagedSource:
        """A READ of device memory: each page's device address (bounds checked), then as
        many staging chunks as its bytes need, only those free now (a responder cannot
        wait): OutOfMemory when they are taken, BadRequest when the pool is too small."""
        pages, nbytes = self._device_pages(region, addrs, lens)
        admitted, chunks = self._take_staging(region, io, nbytes, abort, "a read of", "of")
        return StagedSource(io, chunks, pages, admitted, nbytes)

    @staticmethod
    def _take_staging(region: Region, io: Any, nbytes: int,
                      abort: Callable[[], None] | None, what: str, where: str
                      ) -> tuple[Admitted, list[Any]]:
        """Admit ``region`` and take the staging chunks ``nbytes`` need, only those free
        now (a receiver or responder cannot wait)."""
        pool = io.pool
        need = -(-nbytes // pool.chunk_size)
        if need > pool.capacity:
            raise BadRequest(f"{what} {nbytes} bytes {where} {region.device} memory is "
                             f"larger than its staging ({pool.capacity} x "
                             f"{pool.chunk_size} bytes)")
        admitted = region.admit(abort)
        chunks: list[Any] = []
        for _ in range(need):
            got = pool.try_acquire()
            if got is None:
                for c in chunks:
                    pool.release(c)
                admitted.release()
                raise OutOfMemory(f"staging of {region.device} is taken "
                                  f"({pool.in_use} of {pool.capacity} chunks in use)")
            chunks.append(got)
        return admitted, chunks

    @staticmethod
    def _device_pages(region: Region, addrs: list[int], lens: list[int]
                      ) -> tuple[list[tuple[int, int]], int]:
        pages: list[tuple[int, int]] = []
        total = 0
        for a, n in zip(addrs, lens, strict=True):
            off = a - region.ptr
            if off < 0 or n < 0 or off + n > region.size:
                raise OutOfBounds(f"[0x{a:x}, +{n}) is outside region {region.id} "
                                  f"[0x{region.ptr:x}, +{region.size})")
            pages.append((region.device_address(off, n), n))
            total += n
        return pages, total

    def _staged(self, region: Region, io: Any, addrs: list[int], lens: list[int],
                payload_len: int, abort: Callable[[], None] | None) -> StagedPlacement:
        """Device memory: each page's device address (bounds checked), then staging."""
        pages, total = self._device_pages(region, addrs, lens)
        if total != payload_len:
            raise BadRequest(f"pages hold {total} bytes but the payload has {payload_len}")
        admitted, chunks = self._take_staging(region, io, payload_len, abort, "a write of",
                                              "into")
        return StagedPlacement(io, chunks, pages, admitted, payload_len)

    def count(self, imm: int, n: int) -> int:
        return self.counter.add(imm, n)

    def room(self, imm: int) -> None:
        counter = self.counter
        if not counter.room(imm):
            raise OutOfMemory(f"this daemon holds the counts of {counter.held():,} "
                              f"immediates no expectation has consumed (engine.max_counters "
                              f"= {counter.max_counters:,}): a write with immediate {imm}, "
                              "which has none, is refused")

    def deliver(self, peer: tuple[int, int], msg: bytes, ack: Ack, source: Hashable, *,
                trace: bytes | None = None, op: int = 0) -> None:
        self._deliver(peer, msg, ack, source, trace, op)

    def sender_gone(self, source: Hashable) -> None:
        self._sender_gone(source)
