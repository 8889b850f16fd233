"""Pre-authentication admission: who may hold a handshake slot, for how long, and when a
failed (or held) verdict is answered.  Sans-IO: the time is passed in, nothing is closed
here; the caller closes the connections it is told to.

A stranger must never be able to lock a port by holding its handshake slots.  The rules:

- **Every slot goes back at its deadline** (``timeout`` after the admission, the
  handshake timeout): a connection's slot is never held past it, whatever waits.
  :meth:`Admission.expire` hands out the tickets whose deadline passed (and
  :meth:`Admission.admit` does it first), so even a caller that lost a timer cannot leak
  slots.
- **A newcomer is never refused for a full table: the oldest gives way.**  At
  ``max_per_source`` connections from its source, that source's oldest ticket is evicted
  to make room; at ``max_pending`` in all, the oldest ticket of the source holding the
  most (its own, if none holds more) is.  A ticket whose verdict is decided and waits to
  be answered (a failure's back-off, a held success) goes before one still in its
  handshake.  So silent connections cannot lock out a client that comes later: to push an
  honest client out, a stranger has to open ``max_per_source`` new connections from the
  same source while that client does its two round trips, and a flood from many
  addresses takes the slots of the heaviest sources first.
- **Failures are answered in turn, per source, within the deadline.**  Each failed
  authentication within ``window`` seconds doubles the wait before its answer (``base``
  up to ``cap`` seconds), counted from when the source's previous answer goes out.  An
  answer that would come after the connection's deadline is not given: the connection is
  closed at the deadline without one (and does not push the queue further).  A success
  that the caller holds (:meth:`Admission.success_at`: the token method, whose verdict is
  the only oracle a guesser has) waits for the source's queue the same way, and likewise
  goes unanswered past the deadline; failures and held successes are evicted in the order
  they were decided, so neither the time of an answer nor an eviction tells a guesser
  which guess was right.

What a *source* is belongs to the caller: an IP address for TCP and TLS, the peer's uid
(SO_PEERCRED) for a Unix socket.  The tables are bounded: ``max_pending`` tickets, and
``max_sources`` failure records (the oldest dropped).

No imports beyond the standard library: the RPC client ports and the peer rails both use it.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol


class TicketPhase(enum.Enum):
    HANDSHAKE = "handshake"  # admitted, no verdict yet
    VERDICT = "verdict"  # a verdict is decided and waits for its answer (failure or held success)
    GONE = "gone"  # released, expired or evicted: the slot is free


class Why(enum.Enum):
    """Why a ticket was handed back by :meth:`Admission.admit` or :meth:`Admission.expire`."""

    EXPIRED = "its handshake deadline passed"
    EVICTED_SOURCE = ("the oldest of its source's connections gave way to a newer one "
                      "(the cap per source)")
    EVICTED_TOTAL = ("the oldest of the busiest source's connections gave way to a newer "
                     "one (the cap in all)")


class Holder(Protocol):
    """What holds a ticket (the caller's connection): told when its slot is taken back."""

    def give_way(self, why: Why) -> None: ...


@dataclass(eq=False, slots=True)
class Ticket:
    """One connection's pre-auth slot.  ``owner`` is the caller's (its connection)."""

    source: str
    admitted: float
    deadline: float
    owner: Holder | None = None
    phase: TicketPhase = TicketPhase.HANDSHAKE
    why: Why | None = None  # set when the admission handed it back


@dataclass(slots=True)
class Admitted:
    """What :meth:`Admission.admit` did: the newcomer's ticket (None: refused, ``reason``
    says why), and the tickets the caller must close now (each with its ``why``)."""

    ticket: Ticket | None
    closed: list[Ticket] = field(default_factory=list)
    reason: str = ""


class _Source:
    __slots__ = ("handshake", "verdict")

    def __init__(self) -> None:
        # Insertion order is age order (an OrderedDict as an ordered set).
        self.handshake: OrderedDict[Ticket, None] = OrderedDict()
        self.verdict: OrderedDict[Ticket, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.handshake) + len(self.verdict)

    def oldest(self) -> Ticket:
        """The ticket that gives way first: a decided one, else the oldest in handshake."""
        return next(iter(self.verdict or self.handshake))


class Admission:
    def __init__(
        self,
        max_pending: int = 1024,
        max_per_source: int = 128,
        *,
        timeout: float = 5.0,
        base: float = 0.05,
        cap: float = 2.0,
        window: float = 60.0,
        max_sources: int = 4096,
    ) -> None:
        self.max_pending = max_pending
        self.max_per_source = max_per_source
        self.timeout = timeout
        self.base, self.cap, self.window = base, cap, window
        self.max_sources = max_sources
        # Every live ticket, oldest first (all share one timeout: also deadline order).
        self._order: OrderedDict[Ticket, None] = OrderedDict()
        self._sources: dict[str, _Source] = {}
        # Sources by how many tickets they hold, and the largest such count: the
        # busiest source is found in O(1) when the table is full.
        self._by_count: dict[int, set[str]] = {}
        self._max = 0
        # Counters (metrics, logs): tickets handed back for each reason; refusals.
        self.evicted = 0
        self.expired = 0
        self.refused = 0
        # source -> (failures in the window, time of the last one, the time before which
        # no further verdict of this source is answered)
        self._fails: OrderedDict[str, tuple[int, float, float]] = OrderedDict()

    # -- counts ----------------------------------------------------------------------

    @property
    def pending(self) -> int:
        return len(self._order)

    def count(self, source: str) -> int:
        s = self._sources.get(source)
        return len(s) if s is not None else 0

    # -- admission ---------------------------------------------------------------------

    def admit(self, source: str, now: float, owner: Holder | None = None) -> Admitted:
        """A new connection from ``source``: its ticket, and what must close to make room."""
        out = Admitted(None, self.expire(now))
        if self.max_pending <= 0 or self.max_per_source <= 0:
            self.refused += 1
            out.reason = "no connection may be in its handshake (a cap of 0)"
            return out
        src = self._sources.get(source)
        if src is not None and len(src) >= self.max_per_source:
            out.closed.append(self._evict(src.oldest(), Why.EVICTED_SOURCE))
        elif len(self._order) >= self.max_pending:
            mine = len(src) if src is not None else 0
            if self._max > mine:
                busiest = self._sources[next(iter(self._by_count[self._max]))]
            else:
                assert src is not None  # the table is full and no source holds more
                busiest = src
            out.closed.append(self._evict(busiest.oldest(), Why.EVICTED_TOTAL))
        t = Ticket(source, now, now + self.timeout, owner)
        src = self._sources.get(source)  # an eviction may have emptied (and dropped) it
        if src is None:
            src = self._sources[source] = _Source()
        self._move(source, len(src), len(src) + 1)
        src.handshake[t] = None
        self._order[t] = None
        out.ticket = t
        return out

    @staticmethod
    def close(tickets: list[Ticket]) -> None:
        """Tell the owners of tickets handed back (by admit or expire) that they are out."""
        for t in tickets:
            if t.owner is not None and t.why is not None:
                t.owner.give_way(t.why)

    def release(self, ticket: Ticket) -> None:
        """The connection authenticated or went away (idempotent)."""
        if ticket.phase is TicketPhase.GONE:
            return
        ticket.phase = TicketPhase.GONE
        self._order.pop(ticket, None)
        src = self._sources.get(ticket.source)
        if src is None:
            return
        n = len(src)
        src.handshake.pop(ticket, None)
        src.verdict.pop(ticket, None)
        self._move(ticket.source, n, len(src))
        if not len(src):
            del self._sources[ticket.source]

    def expire(self, now: float) -> list[Ticket]:
        """Tickets whose deadline passed, released (the caller closes their connections)."""
        out: list[Ticket] = []
        order = self._order
        while order:
            t = next(iter(order))
            if t.deadline > now:
                break
            self.release(t)
            t.why = Why.EXPIRED
            self.expired += 1
            out.append(t)
        return out

    def next_deadline(self) -> float | None:
        """When :meth:`expire` next has something to hand out (None: nothing is pending)."""
        return next(iter(self._order)).deadline if self._order else None

    def _evict(self, t: Ticket, why: Why) -> Ticket:
        self.release(t)
        t.why = why
        self.evicted += 1
        return t

    def _move(self, source: str, old: int, new: int) -> None:
        if old:
            bucket = self._by_count[old]
            bucket.discard(source)
            if not bucket:
                del self._by_count[old]
        if new:
            self._by_count.setdefault(new, set()).add(source)
        if new > self._max:
            self._max = new
        elif old == self._max and old not in self._by_count:
            # Counts move by one, so the next largest is one less (or nothing is left).
            self._max = old - 1 if (old - 1) in self._by_count else max(self._by_count, default=0)

    def _decided(self, t: Ticket) -> None:
        if t.phase is not TicketPhase.HANDSHAKE:
            return
        src = self._sources[t.source]
        src.handshake.pop(t, None)
        src.verdict[t] = None
        t.phase = TicketPhase.VERDICT

    # -- verdicts ----------------------------------------------------------------------

    def failed(self, ticket: Ticket, now: float) -> tuple[float | None, int]:
        """A failed authentication on ``ticket``: (when its answer may go out, failures of
        its source in the window).  None: not before its deadline, so it gets none (the
        caller closes it at its deadline, or :meth:`expire` hands it out)."""
        source = ticket.source
        count, last, free = self._fails.pop(source, (0, now, now))
        if now - last > self.window:
            count, free = 0, now
        count += 1
        answer = max(now, free) + min(self.cap, self.base * (1 << min(count - 1, 20)))
        # Past the deadline it is not answered, and the queue does not grow for it.
        at = answer if answer <= ticket.deadline else None
        self._fails[source] = (count, now, answer if at is not None else free)
        while len(self._fails) > self.max_sources:
            self._fails.popitem(last=False)
        if ticket.phase is not TicketPhase.GONE:
            self._decided(ticket)
        return at, count

    def success_at(self, ticket: Ticket, now: float) -> float | None:
        """When a held success on ``ticket`` may be answered: ``now`` unless failures of its
        source are still waiting for their answers (then after them); None when that is
        past the ticket's deadline (no answer: closed at the deadline like a failure)."""
        rec = self._fails.get(ticket.source)
        if rec is None or now - rec[1] > self.window or rec[2] <= now:
            return now
        if ticket.phase is not TicketPhase.GONE:
            self._decided(ticket)
        return rec[2] if rec[2] <= ticket.deadline else None

    def verdicts(self, ticket: Ticket) -> TicketVerdicts:
        """The verdict timing of ``ticket``'s connection, for its sans-IO connection
        (``transferd.protocol.connection.Verdicts``)."""
        return TicketVerdicts(self, ticket)

    def failures(self, source: str) -> int:
        return self._fails.get(source, (0, 0.0, 0.0))[0]


class TicketVerdicts:
    """:meth:`Admission.failed` and :meth:`Admission.success_at` bound to one ticket."""

    __slots__ = ("_admission", "_ticket")

    def __init__(self, admission: Admission, ticket: Ticket) -> None:
        self._admission = admission
        self._ticket = ticket

    def failed(self, now: float) -> tuple[float | None, int]:
        return self._admission.failed(self._ticket, now)

    def success_at(self, now: float) -> float | None:
        return self._admission.success_at(self._ticket, now)
