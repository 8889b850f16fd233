"""The receiving side's rules, once for every Domain: claim, check, land or fail, count.

A peer's WRITE is opened (:meth:`Landing.open`) before any byte of it lands:

1. **claim** its write id, if it has one (:mod:`.peer_writeids`): one applied here
   before is a duplicate (acknowledged ok, placed and counted nothing); one still
   landing from an earlier attempt is TIMEOUT; a claimed one must be committed or
   failed;
2. **check** it against memory (:class:`Memory`, the engine's side: the region its
   rkey opens on this rail, every page inside it, the payload exactly the pages'
   bytes, the region's admission); a part re-sent on another rail whose first copy
   landed is a duplicate too; a part of a split single write reserves its range of
   the write's span (:mod:`.peer_coverage`);
3. then the Domain lands the bytes where the :class:`Admission` says (its views),
   and a part that carries a checksum is **verified** over them
   (:meth:`Admission.verify`: CRC32C of the bytes placed, or of the staging copy
   for device memory, before it counts), and
4. **commits** (:meth:`Admission.commit`): the counter moves by what landed, never
   by a number the peer sent (one per page placed, one per split write once its
   span is covered, one for a frame of no pages), or **fails**
   (:meth:`Admission.fail`): nothing counts, the claim and the range go back (a
   retry may land), the memory's admission is let go.

Everything here is bookkeeping on one loop (the group's worker); :class:`Memory` is
the only way out, and it is the engine's.  No I/O, no clock but the write ids'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from .crc import crc_of
from .errors import BadRequest, IntegrityError, TransferdError
from .peer_coverage import Coverage, Landed, Partial, fingerprint
from .peer_wire import WriteHeader
from .peer_writeids import Seen, WriteIds

Peer = tuple[int, int]
# (peer, rail) pairs whose checksum failures are counted apart (metrics labels).
MAX_INTEGRITY_KEYS = 1024
Done = Callable[[TransferdError | None], None]


class Placement(Protocol):
    """Memory a checked write may land in, held (admitted) until :meth:`release`."""

    @property
    def views(self) -> Sequence[memoryview]:
        """Where the payload goes, in order: the pages (host memory) or staging chunks."""

    @property
    def deferred(self) -> bool:
        """True when the bytes are not in place once received (device memory: they
        went to staging): :meth:`land` puts them there, then the write counts."""

    def land(self, done: Done) -> None:
        """Deferred only: move the received bytes home; ``done`` from any thread."""

    @property
    def crc(self) -> int | None:
        """A READ's source asked with ``checksum``: the CRC32C of :attr:`views` where
        the memory side took it (set by the time :meth:`land` is done); None: not
        taken, the link takes it."""

    def release(self) -> None:
        """Let go of the memory (once; the write landed or failed)."""


class Source(Placement, Protocol):
    """Memory a checked READ is answered from, held (admitted) until :meth:`release`
    or :meth:`abandon`."""

    def abandon(self) -> None:
        """Deferred only: the link closed before ``land``'s ``done`` was answered.  Let go
        of the memory once: now, or once what runs on it ended (a checksum stops, a
        device's copy ends); nothing more is started, and a ``done`` after this is for
        nobody.  Instead of :meth:`release`, never with it."""


class Memory(Protocol):
    """The engine's side of landing: regions and the immediate counter."""

    def place(self, rkey: int, rail: int, addrs: list[int], lens: list[int],
              payload_len: int, abort: Callable[[], None] | None) -> Placement:
        """Check a write against the region ``rkey`` opens on ``rail`` and admit it.

        NotFound (no such region), OutOfBounds (a page outside it), BadRequest (the
        payload is not the pages' bytes), OutOfMemory (no staging).  ``abort`` (any
        thread) cuts the landing short if the region goes meanwhile.
        """
        ...

    def count(self, imm: int, n: int) -> int | None:
        """Add ``n`` to immediate ``imm`` (thread safe); how many expectations that met
        (their callbacks may have run), or None."""

    def room(self, imm: int) -> None:
        """Raise the TransferdError refusing a write with ``imm`` before it lands when
        its count could not be held (engine.max_counters: OutOfMemory); else nothing."""

    def source(self, rkey: int, rail: int, addrs: list[int], lens: list[int],
               abort: Callable[[], None] | None, checksum: bool = False,
               peer: Peer | None = None) -> Source:
        """A peer's READ: the pages of the region ``rkey`` opens *for reading* on
        ``rail``, checked and admitted (its ``views`` are what is sent back).
        ``checksum``: the answer carries the CRC32C of those bytes, which the memory
        side may take itself (:attr:`Placement.crc`; e.g. off the link's loop, in turn
        with other peers' READs: ``peer`` is the authenticated one asking).

        NotFound (no such region, or one registered without "r": the same answer),
        OutOfBounds (a page outside it), BadRequest (memory it cannot read from).
        """
        ...


class Admission:
    """One opened WRITE: where its payload goes, then :meth:`commit` or :meth:`fail`."""

    __slots__ = ("_claimed", "_landing", "_partial", "_placement", "deferred", "duplicate",
                 "header", "met", "peer", "rail", "views")

    def __init__(self, landing: Landing, peer: Peer, w: WriteHeader,
                 placement: Placement | None, partial: Partial | None, claimed: bool,
                 rail: int = 0) -> None:
        self._landing = landing
        self.peer = peer
        self.rail = rail
        self.header = w
        self._placement = placement
        self._partial = partial
        self._claimed = claimed
        #: Applied here before: acknowledge ok; the payload is read and dropped.
        self.duplicate = placement is None
        self.views: Sequence[memoryview] = placement.views if placement is not None else ()
        self.deferred = placement is not None and placement.deferred
        #: Expectations its count met when committed (their clients heard of it).
        self.met = 0

    def land(self, done: Done) -> None:
        """A deferred admission's bytes were received: move them home, then ``done``."""
        assert self._placement is not None
        self._placement.land(done)

    def verify(self, got: int | None = None) -> IntegrityError | None:
        """A part with a checksum: CRC32C of what was placed (its views: the pages, or
        the staging chunks of device memory) against the sender's; the error refusing
        it if they differ (counted by peer and rail; fail it with that error).

        ``got``: the CRC32C the link took of the bytes as each receive placed them (in
        order, over these views), so that they are not read again from memory."""
        w = self.header
        if w.crc is None or self._placement is None:
            return None
        if got is None:
            got = crc_of(self.views)
        if got == w.crc:
            return None
        self._landing.integrity_failed(self.peer[0], self.rail)
        return IntegrityError(
            f"checksum mismatch: part {w.part} of op {w.op} ({w.nbytes} bytes) from node "
            f"{self.peer[0]:016x} rail {self.rail}: CRC32C 0x{got:08x} placed, 0x{w.crc:08x} "
            "sent; not counted")

    def commit(self, nbytes: int) -> None:
        """Every byte is in place: count what landed (once) and let the memory go."""
        lg, w, peer = self._landing, self.header, self.peer
        placement, self._placement = self._placement, None
        if placement is not None:
            placement.release()
            if lg.remember or w.crc is not None:  # (a mismatch re-sends on the same rail)
                lg.landed.add((peer[0], peer[1], w.op, w.part), fingerprint(w.addrs, w.lens))
            lg.bytes_in += nbytes
            lg.writes_in += 1
            if w.span is not None:
                assert self._partial is not None
                n = 1 if lg.coverage.landed(_cover_key(peer, w), self._partial, nbytes,
                                            w.addrs[0]) else 0
            else:
                n = len(w.addrs) or 1
            if w.imm is not None and n:
                self.met = lg.memory.count(w.imm, n) or 0
                lg.imms_in += n
        if self._claimed:
            self._claimed = False
            lg.write_ids.applied(peer, w)

    def fail(self, error: TransferdError | None = None) -> None:
        """It did not land (``error``: refused; None: its link went away): nothing
        counts, a retry with its write id may land, the memory goes."""
        lg, w = self._landing, self.header
        placement, self._placement = self._placement, None
        if placement is not None:
            placement.release()
        if self._claimed:
            self._claimed = False
            lg.write_ids.failed(self.peer, w)
            if self._partial is not None and w.span is not None:
                lg.coverage.unreserve(_cover_key(self.peer, w), self._partial, w.addrs[0],
                                      w.lens[0])
        if error is not None:
            lg.refused(error)


class Landing:
    """The rules every inbound link of one domain group shares (see the module doc).

    ``rails``: the group's rail count.  A part is re-sent only on another rail, so
    with one rail no part is remembered as landed (nothing could be its re-send).
    """

    def __init__(self, memory: Memory, rails: int = 1, write_ids: WriteIds | None = None,
                 coverage: Coverage | None = None, landed: Landed | None = None,
                 require_crc: bool = False) -> None:
        self.memory = memory
        # engine.verify: a WRITE with a payload and no checksum is refused.
        self.require_crc = require_crc
        # Checksum mismatches by (peer node, rail); bounded (the rest under node 0): of
        # the writes landed here and of the answers to this daemon's reads.
        self.integrity_failures: dict[tuple[int, int], int] = {}
        # The chaos Domain's engine.chaos_corrupt: what a READ's answer is sent from
        # (a corrupted copy of its views, or None: the views themselves); else None.
        self.corrupt_read: Callable[[Sequence[memoryview]], Sequence[memoryview] | None] \
            | None = None
        self.remember = rails > 1
        # (Not ``or``: an empty table is falsy, and the caller's is the one to use.)
        self.write_ids = WriteIds() if write_ids is None else write_ids
        self.coverage = Coverage() if coverage is None else coverage
        self.landed = Landed() if landed is None else landed
        # Tallies the metrics read when scraped.
        self.writes_in = 0
        self.bytes_in = 0
        self.imms_in = 0
        self.refused_by: dict[str, int] = {}
        self.reads_out = 0
        self.read_bytes_out = 0
        self.reads_refused_by: dict[str, int] = {}

    @property
    def duplicates(self) -> int:
        """Re-sent parts that had landed (acknowledged, not applied again)."""
        return self.landed.duplicates

    def integrity_failed(self, node: int, rail: int) -> None:
        """One checksum mismatch of bytes from ``node`` on ``rail`` (a write landed here,
        or the answer to a read of ours)."""
        key = (node, rail)
        failures = self.integrity_failures
        if key in failures or len(failures) < MAX_INTEGRITY_KEYS:
            failures[key] = failures.get(key, 0) + 1
        else:
            failures[(0, rail)] = failures.get((0, rail), 0) + 1

    def refused(self, error: TransferdError) -> None:
        code = error.code.value
        self.refused_by[code] = self.refused_by.get(code, 0) + 1

    def open(self, peer: Peer, rail: int, w: WriteHeader, payload_len: int,
             abort: Callable[[], None] | None = None) -> Admission:
        """Claim and check ``w`` (from the authenticated ``peer``, on ``rail``) before a
        byte lands; raises the TransferdError that refuses it (counted)."""
        claimed = False
        if self.require_crc and w.crc is None and payload_len:
            exc = BadRequest(f"peer WRITE without a checksum: this daemon verifies every "
                             f"write it receives (engine.verify); part {w.part} of op {w.op} "
                             "refused")
            self.refused(exc)
            raise exc
        try:
            if w.wid is not None:
                if self.write_ids.claim(peer, w) is Seen.APPLIED:
                    return Admission(self, peer, w, None, None, False)
                claimed = True
            placement = self.memory.place(w.rkey, rail, w.addrs, w.lens, payload_len, abort)
        except TransferdError as exc:
            if claimed:
                self.write_ids.failed(peer, w)
            self.refused(exc)
            raise
        if w.again and (self.remember or w.crc is not None) and self.landed.seen(
                (peer[0], peer[1], w.op, w.part), fingerprint(w.addrs, w.lens)):
            # Its first copy landed (its ACK was lost with the rail): once is enough.
            placement.release()
            self.landed.duplicates += 1
            return Admission(self, peer, w, None, None, claimed, rail)
        partial = None
        try:
            if w.imm is not None:
                # (A count nobody consumes is held for good: their number is bounded.
                # Asked after a re-sent part that landed is known: that one counts
                # nothing more.)
                self.memory.room(w.imm)
            if w.span is not None:
                partial = self.coverage.reserve(_cover_key(peer, w), w.span, w.addrs[0],
                                                w.lens[0], w.imm, w.again)
        except TransferdError as exc:
            placement.release()
            if claimed:
                self.write_ids.failed(peer, w)
            self.refused(exc)
            raise
        return Admission(self, peer, w, placement, partial, claimed, rail)

    def read(self, rail: int, rkey: int, addrs: list[int], lens: list[int],
             abort: Callable[[], None] | None = None, checksum: bool = False,
             peer: Peer | None = None) -> Source:
        """Check a peer's READ (from the authenticated ``peer``) against memory and admit
        it (release once sent); raises the TransferdError that refuses it (counted).
        Nothing is counted: a READ carries no immediate."""
        try:
            src = self.memory.source(rkey, rail, addrs, lens, abort, checksum, peer)
        except TransferdError as exc:
            code = exc.code.value
            self.reads_refused_by[code] = self.reads_refused_by.get(code, 0) + 1
            raise
        self.reads_out += 1
        self.read_bytes_out += sum(lens)
        return src

    def landed_imm(self, imm: int, nbytes: int) -> None:
        """A unit with its immediate landed where the NIC counts (verbs WRITE_WITH_IMM):
        one count, the bytes placed by the NIC.  The NIC placed them before anyone could
        ask for room, so a count past engine.max_counters is not held but refused here
        (OutOfMemory, counted, raised: its link is to be closed, so that the initiator's
        writes fail from now on rather than the table growing with every immediate a
        peer makes up)."""
        imm &= 0xFFFFFFFF
        try:
            self.memory.room(imm)
        except TransferdError as exc:
            self.refused(exc)  # (a refused write, as on tcp: not among those landed)
            raise
        self.bytes_in += nbytes
        self.writes_in += 1
        self.memory.count(imm, 1)
        self.imms_in += 1


def _cover_key(peer: Peer, w: WriteHeader) -> tuple[int, int, int]:
    """A split write's coverage key: by op, or by write id (negative, so never an op)
    when it has one, so a first attempt's parts and a retry's cover one span."""
    return (peer[0], peer[1], w.op if w.wid is None else -1 - w.wid)


__all__ = ["Admission", "Landing", "Memory", "Placement", "Source"]
