"""Rail failover: a part whose rail fails is re-sent on another rail of the group.

The plan puts every part on a rail (a split write one part per rail).  When a
link fails under a part -- it cannot be dialled, its handshake fails, or it
breaks (a cut cable: the kernel gives up on unacknowledged bytes after
``engine.rail_timeout_s``, TCP_USER_TIMEOUT) -- the part is posted again on a
rail of the same peer not tried yet for it, with the destination's rkey on
that rail (the part carries its MrDesc's rkeys).  Only PEER_UNREACHABLE is
retried this way: any answer from the peer (NOT_FOUND, OUT_OF_BOUNDS, ...)
is the transfer's.

The (peer, rail) that failed is marked down for a while (0.25 s, doubling per
failure to 10 s): meanwhile parts planned on it go straight to a rail that is
up.  When the while is over, the next part planned on it goes there again --
the probe: if it gets through the rail is up again (used by every part
after); if not it is re-sent elsewhere and the rail stays down for longer.

The receiver makes a re-send safe (:mod:`.group`): a part of a split write
whose range was already taken is taken again (the range lands, and counts,
once), and a part that already landed is recognised by (peer, op, part) and
its pages in a bounded window and acknowledged without landing or counting
again.

A verified part whose checksum did not match where it landed (INTEGRITY: the
receiver counted nothing of it) is re-sent once, on another rail if there is
one, without marking its rail down; a second mismatch fails the transfer with
that IntegrityError (docs/integrity.md).  A verified READ whose answer did not
match its checksum where this daemon placed it is re-read the same way (and the
mismatch counted here, by peer and rail).

Two-sided SENDs are not re-sent (a message could be delivered twice).  A READ's part
is re-read on another rail the same way (a READ changes nothing at the peer; the
part's bytes are received again, whole, into the same place).
Everything here runs on the group's worker loop.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from transferd.logs import trace_fields
from transferd.parts import ReadPart, Transfer, WritePart
from transferd.protocol.errors import IntegrityError, PeerUnreachable, TransferdError

if TYPE_CHECKING:
    from .group import DomainGroup

log = logging.getLogger("transferd.domain")

DOWN_MIN_S = 0.25
DOWN_MAX_S = 10.0
# How many doublings take DOWN_MIN_S past DOWN_MAX_S (and no more are computed).
DOUBLINGS = 8
# (peer, rail) pairs remembered as down; the oldest forgotten first.
MAX_DOWN = 4096

RailKey = tuple[tuple[int, int], int]  # ((node, group), rail)


class RailHealth:
    """Which (peer, rail) pairs failed lately, and when each may be tried again."""

    def __init__(self, rails: int) -> None:
        self.rails = rails
        # (peer, rail) -> (failures in a row, not before)
        self._down: OrderedDict[RailKey, tuple[int, float]] = OrderedDict()
        self.failovers = 0  # parts re-sent on another rail (metrics, tests)

    def is_down(self, peer: tuple[int, int], rail: int, now: float) -> bool:
        d = self._down.get((peer, rail))
        return d is not None and now < d[1]

    def pick(self, peer: tuple[int, int], rail: int, now: float,
             avoid: frozenset[int] = frozenset()) -> int | None:
        """``rail`` if it is up (or due a probe), else the next rail up; None if none is."""
        for k in range(self.rails):
            r = (rail + k) % self.rails
            if r not in avoid and not self.is_down(peer, r, now):
                return r
        return None

    def failed(self, peer: tuple[int, int], rail: int, now: float) -> None:
        key = (peer, rail)
        n = self._down.pop(key, (0, 0.0))[0] + 1
        # The doubling stops at the cap: 2 ** n for a rail that failed a thousand times
        # in a row (parts failing as fast as they are submitted) is no float.
        backoff = DOWN_MIN_S * 2 ** min(n - 1, DOUBLINGS)
        self._down[key] = (n, now + min(backoff, DOWN_MAX_S))
        if n == 1:
            log.warning("rail %d to node %016x: down; its parts go on the other rails",
                        rail, peer[0])
        while len(self._down) > MAX_DOWN:
            self._down.popitem(last=False)

    def worked(self, peer: tuple[int, int], rail: int) -> None:
        if self._down.pop((peer, rail), None) is not None:
            log.warning("rail %d to node %016x: up again", rail, peer[0])


def move(part: WritePart | ReadPart, rail: int) -> None:
    """Point ``part`` at ``rail``: that rail's address and rkey of its destination."""
    assert part.alts is not None
    part.rail = rail
    part.dst, part.rkey = part.alts[rail]


class Resend:
    """The Transfer a Domain sees for one part that may be re-sent on another rail.

    Domains call ``part_done`` / ``fail`` and read ``finished``, as on a
    :class:`~transferd.parts.Transfer`; a retryable failure re-posts the part
    instead of failing the transfer.
    """

    __slots__ = ("group", "part", "rechecked", "transfer", "tried")

    def __init__(self, group: DomainGroup, transfer: Transfer,
                 part: WritePart | ReadPart) -> None:
        self.group = group
        self.transfer = transfer
        self.part = part
        self.tried = frozenset({part.rail})
        self.rechecked = False  # re-sent once after a checksum mismatch

    @property
    def finished(self) -> bool:
        return self.transfer.finished

    @property
    def op(self) -> int:
        return self.transfer.op

    def part_done(self, error: TransferdError | None = None) -> None:
        if error is None:
            self.group.health.worked(self.part.dst.key, self.part.rail)
            self.transfer.part_done()
        elif not self._resend(error):
            self.transfer.part_done(error)

    def fail(self, error: TransferdError) -> None:
        if not self._resend(error):
            self.transfer.fail(error)

    def _resend(self, error: TransferdError) -> bool:
        if type(error) is IntegrityError:
            return self._recheck(error)
        if type(error) is not PeerUnreachable or self.transfer.finished:
            return False
        g, part = self.group, self.part
        now = g.loop.time()
        peer = part.dst.key
        g.health.failed(peer, part.rail, now)
        rail = g.health.pick(peer, part.rail, now, self.tried)
        if rail is None:  # every other rail is down: try one not tried yet anyway
            rail = next((r for r in range(len(g.domains)) if r not in self.tried), None)
        if rail is None:
            return False
        self.tried |= {rail}
        was = part.rail
        move(part, rail)
        part.again = True
        g.health.failovers += 1
        log.info("part %d of op %d: rail %d failed (%s), re-sent on rail %d",
                 part.index, part.op, was, error.message, rail)
        g.domains[rail].post(part, self)  # type: ignore[arg-type]
        return True

    def _recheck(self, error: IntegrityError) -> bool:
        """The receiver refused the part's bytes (checksum): once more, on another rail
        if there is one; False (the transfer fails with ``error``) the second time."""
        g, part = self.group, self.part
        if type(part) is ReadPart:
            # The reader found it (the writes' receivers count theirs where they land).
            g.landing.integrity_failed(part.dst.node, part.rail)
        if self.rechecked or self.transfer.finished:
            return False
        self.rechecked = True
        was = part.rail
        rails = len(g.domains)
        if rails > 1 and part.alts is not None:
            rail = g.health.pick(part.dst.key, (was + 1) % rails, g.loop.time(),
                                 frozenset({was}))
            move(part, (was + 1) % rails if rail is None else rail)
        part.again = True
        g.integrity_resends += 1
        log.warning("part %d of op %d: checksum mismatch %s node %016x rail %d (%s); "
                    "%s on rail %d", part.index, part.op,
                    "of the answer from" if type(part) is ReadPart else "at", part.dst.node,
                    was, error.message,
                    "re-read" if type(part) is ReadPart else "re-sent", part.rail,
                    extra=trace_fields(part.trace))
        g.domains[part.rail].post(part, self)  # type: ignore[arg-type]
        return True
