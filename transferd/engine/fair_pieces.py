"""The engine port's checksum thread, shared fairly among the peers whose READs wait.

A peer's verified READ past CRC_INLINE_MAX of host memory has its CRC32C taken on
the port's one thread, a piece (CRC_PIECE) at a time (port.ChecksummedSource).  The
thread took them first come first served: one peer's READ of 4096 overlapping pages
of a 4000 MiB region (16 TB of checksum, minutes of a core) held every other peer's
verified READ behind it for as long.  Now its pieces go round-robin across peers
(the READ's authenticated peer: its node and group), first come first served within
one peer; a READ with more to take goes to the back of the rotation after each
piece.  A peer's READ of N bytes then waits for at most one piece of each other peer
per piece of its own: with one other peer asking, about twice its own checksum time
however much that other asks (k peers asking: k + 1 times).

:class:`FairPieces` is which piece comes next (no thread, no clock: tested alone);
:class:`PieceThread` runs it on one thread, made when a job comes and ended when none
is left, refusing what waits once the port closes.

Bounded: a tcp link holds one READ whose memory side is not ready (it reads nothing
more until answered), so no more wait than the engine has links (engine.max_links);
the port passes that as ``limit`` and a job past it is refused (OutOfMemory).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

from transferd.protocol.errors import OutOfMemory, PeerUnreachable, TransferdError

log = logging.getLogger(__name__)


class Job(Protocol):
    """What the thread takes pieces of (a ChecksummedSource)."""

    def step(self) -> bool:
        """Take one piece (on the thread); True while there is more to take."""
        ...

    def refuse(self, error: TransferdError) -> None:
        """The port closed while it waited: it is answered ``error``, nothing taken."""
        ...


J = TypeVar("J")


class FairPieces(Generic[J]):
    """Jobs by lane (a peer): :meth:`next` is the head job of the lane whose turn it is;
    after its piece (:meth:`took`) that lane goes to the back of the rotation.  At most
    ``limit`` jobs in all (:meth:`add` refuses past it)."""

    __slots__ = ("_jobs", "_lanes", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # Lanes with a job waiting, in the order their turns come; FIFO in each.
        self._lanes: OrderedDict[Hashable, deque[J]] = OrderedDict()
        self._jobs = 0

    def __len__(self) -> int:
        return self._jobs

    @property
    def lanes(self) -> int:
        return len(self._lanes)

    def add(self, lane: Hashable, job: J) -> None:
        if self._jobs >= self.limit:
            raise OutOfMemory(f"{self._jobs} READ checksums wait for this daemon's checksum "
                              f"thread (at most {self.limit}, engine.max_links): refused")
        q = self._lanes.get(lane)
        if q is None:
            # A lane new to the rotation comes after every lane waiting now.
            self._lanes[lane] = q = deque()
        q.append(job)
        self._jobs += 1

    def next(self) -> tuple[Hashable, J] | None:
        """The lane whose turn it is and its first job (left in place), or None."""
        for lane, q in self._lanes.items():
            return lane, q[0]
        return None

    def took(self, lane: Hashable, job: J, more: bool) -> None:
        """A piece of ``job`` (from :meth:`next`) was taken; ``more``: it has more, and
        stays first of its lane.  Either way the lane had its turn."""
        q = self._lanes.get(lane)
        if q is None:
            return  # (withdrawn while its piece was taken, the last of its lane)
        if not more and q[0] is job:
            q.popleft()
            self._jobs -= 1
            if not q:
                del self._lanes[lane]
                return
        self._lanes.move_to_end(lane)

    def withdraw(self, lane: Hashable, job: J) -> bool:
        """``job`` goes before its turn (its link went): False where it is not here."""
        q = self._lanes.get(lane)
        if q is None:
            return False
        try:
            q.remove(job)
        except ValueError:
            return False
        self._jobs -= 1
        if not q:
            del self._lanes[lane]
        return True

    def drain(self) -> list[J]:
        """Every job waiting, in lane order, and none left."""
        jobs = [j for q in self._lanes.values() for j in q]
        self._lanes.clear()
        self._jobs = 0
        return jobs


class Shift(enum.Enum):
    """Where a PieceThread is."""

    IDLE = "idle"  # no thread: none made yet, or the last one found nothing to do
    RUNNING = "running"  # a thread takes pieces
    CLOSED = "closed"  # the port closed: nothing more taken, nothing more queued


class PieceThread:
    """Runs :class:`FairPieces` of :class:`Job` on one thread (named ``name``), made
    when a job is queued with none running and gone when none is left: nothing runs
    while no READ waits, and a process that never closes its port is not kept
    alive by an idle thread.  Its calls are thread safe (links on several loops)."""

    def __init__(self, limit: int, name: str = "read-crc") -> None:
        self._pieces: FairPieces[Job] = FairPieces(limit)
        self._lock = threading.Lock()
        self._name = name
        self._shift = Shift.IDLE

    @property
    def shift(self) -> Shift:
        return self._shift

    def waiting(self) -> tuple[int, int]:
        """(jobs, lanes) queued now."""
        with self._lock:
            return len(self._pieces), self._pieces.lanes

    def submit(self, lane: Hashable, job: Job) -> None:
        """Queue ``job`` in ``lane``: PeerUnreachable once closed (no thread made for
        it), OutOfMemory past the limit."""
        with self._lock:
            if self._shift is Shift.CLOSED:
                raise PeerUnreachable("this daemon's engine is closing: a READ's checksum "
                                      "is not taken")
            self._pieces.add(lane, job)
            if self._shift is Shift.RUNNING:
                return
            t = threading.Thread(target=self._run, name=self._name, daemon=False)
            try:
                t.start()
            except RuntimeError as exc:  # (no more threads, or the interpreter ending)
                self._pieces.withdraw(lane, job)
                raise PeerUnreachable(f"a READ's checksum cannot be taken: {exc}") from None
            self._shift = Shift.RUNNING

    def withdraw(self, lane: Hashable, job: Job) -> None:
        with self._lock:
            self._pieces.withdraw(lane, job)

    def close(self) -> None:
        """Nothing more is queued; the thread refuses what waits after the piece in
        hand (a job whose last piece that was is answered with its checksum)."""
        # (No thread running: nothing queued, since a job queued starts one.)
        with self._lock:
            self._shift = Shift.CLOSED

    def _run(self) -> None:
        pieces, lock = self._pieces, self._lock
        while True:
            with lock:
                if self._shift is Shift.CLOSED:
                    left = pieces.drain()
                    break
                turn = pieces.next()
                if turn is None:
                    self._shift = Shift.IDLE  # (the next job makes a thread again)
                    return
            lane, job = turn
            try:
                more = job.step()
            except Exception:  # (a job's own faults are its answer: this is a bug)
                log.exception("a READ's checksum failed on the checksum thread")
                more = False
            with lock:
                pieces.took(lane, job, more)
        for job in left:
            try:
                job.refuse(PeerUnreachable("this daemon's engine closed: a READ's "
                                           "checksum is not taken"))
            except Exception:
                log.exception("a READ refused at the close failed")


__all__ = ["FairPieces", "Job", "PieceThread", "Shift"]
