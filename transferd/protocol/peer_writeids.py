"""Write ids: a retried write is applied and counted at most once.

A client may give SINGLE_WRITE or PAGED_WRITES a write id (``wid``, u64 of its
choosing); every WRITE frame of that write carries it.  The receiver remembers
each frame it applied by (initiator node, initiator group, wid, part) for a bounded
count and time (``engine.write_id_window``, ``engine.write_id_ttl_s``).  A retry
plans the same frames (same parts, same ranges), so:

- a frame whose key was applied is acknowledged ``ok`` and neither placed nor
  counted again;
- a frame whose key is landing right now (the first attempt, on another link, still
  receiving its payload) is refused with TIMEOUT (outcome unknown: retry later with
  the same wid), so it can neither double-count nor report a result it does not know;
- a frame whose first attempt failed (refused, or its link died mid-payload) left
  nothing behind and lands normally.

The parts of a split single write count once when their ranges cover the span: with a
wid, coverage is by (peer, wid) instead of (peer, op), so a span covered partly by the
first attempt and partly by the retry counts once, when it is covered.  A key also
remembers what its frame named (ranges, immediate, span): the same wid and part
with other contents is BAD_REQUEST (a wid names one write).  Runs on the group's
worker loop only.  Pure bookkeeping, bounded.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable

from .errors import BadRequest, Timeout
from .peer_wire import WriteHeader

# Defaults of engine.write_id_window (per initiating peer) and engine.write_id_ttl_s.
WINDOW = 16384
TTL_S = 600.0
# All peers together remember at most this many windows' worth (the largest peer's
# oldest go first past it), so one peer can neither push another's out nor grow this
# without bound.  An entry costs about 200 bytes.
PEERS_WINDOWS = 4
# Frames landing at once with an id (one per inbound link at a time; a bound anyway).
MAX_LANDING = 65536

Peer = tuple[int, int]
Key = tuple[int, int]  # (wid, part), per peer


class Seen(enum.Enum):
    NEW = "new"  # land it (claimed now: applied() or failed() must follow)
    APPLIED = "applied"  # acknowledge ok, place nothing, count nothing


def _what(w: WriteHeader) -> int:
    # Not the rkey: a retry may go over another rail (the plan rotates rails by op),
    # and each rail has its own.  The absolute ranges name the destination.  A hash
    # (of ints: the same in every process) keeps an entry small.
    return hash((tuple(w.addrs), tuple(w.lens), w.imm, w.span))


class WriteIds:
    def __init__(self, window: int = WINDOW, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.ttl_s = ttl_s
        self._clock = clock
        self._applied: dict[Peer, OrderedDict[Key, tuple[float, int]]] = {}
        # The peers by how many entries their window holds, and the most any holds (at
        # most): the largest is found without a scan over every peer (thousands, minted
        # without a cluster secret, each a window of one).
        self._sizes: dict[int, dict[Peer, None]] = {}
        self._top = 0
        self._total = 0
        self._landing: dict[tuple[Peer, Key], int] = {}
        self.duplicates = 0

    def configure(self, window: int, ttl_s: float, clock: Callable[[], float]) -> None:
        self.window, self.ttl_s, self._clock = window, ttl_s, clock

    def __len__(self) -> int:
        return self._total

    def claim(self, peer: Peer, w: WriteHeader) -> Seen:
        """Before a frame with a wid is placed: APPLIED (acknowledge it ok, do nothing)
        or NEW (claimed: call :meth:`applied` or :meth:`failed` after)."""
        assert w.wid is not None
        k = (w.wid, w.part)
        what = _what(w)
        table = self._applied.get(peer)
        if table is not None:
            self._expire(peer, table)
            seen = table.get(k)
            if seen is not None:
                if seen[1] != what:
                    raise BadRequest(f"write id {w.wid} part {w.part} was applied with other "
                                     "contents (a write id names one write)")
                self.duplicates += 1
                return Seen.APPLIED
        if (peer, k) in self._landing:
            raise Timeout(f"write id {w.wid} part {w.part} is still landing from an earlier "
                          "attempt: outcome unknown, retry with the same id")
        if len(self._landing) >= MAX_LANDING:
            raise BadRequest(f"{MAX_LANDING} writes with ids are landing here at once")
        self._landing[(peer, k)] = what
        return Seen.NEW

    def applied(self, peer: Peer, w: WriteHeader) -> None:
        """The claimed frame's bytes are in place (and counted, by the counting rules)."""
        assert w.wid is not None
        k = (w.wid, w.part)
        what = self._landing.pop((peer, k), None)
        table = self._applied.setdefault(peer, OrderedDict())
        had = len(table)
        if k not in table:
            self._total += 1
        table[k] = (self._clock(), what if what is not None else _what(w))
        table.move_to_end(k)
        while len(table) > self.window:
            table.popitem(last=False)
            self._total -= 1
        self._resized(peer, had, len(table))
        while self._total > self.window * PEERS_WINDOWS:
            who = self._largest()
            largest = self._applied[who]
            largest.popitem(last=False)
            self._total -= 1
            self._resized(who, len(largest) + 1, len(largest))
            if not largest:
                del self._applied[who]  # (no window left behind per peer ever seen)

    def _resized(self, peer: Peer, old: int, new: int) -> None:
        """``peer``'s window went from ``old`` entries to ``new``."""
        if old == new:
            return
        sizes = self._sizes
        if old:
            bucket = sizes[old]
            del bucket[peer]
            if not bucket:
                del sizes[old]
        if new:
            sizes.setdefault(new, {})[peer] = None
            if new > self._top:
                self._top = new

    def _largest(self) -> Peer:
        """The peer whose window holds the most entries (the first to get there)."""
        sizes = self._sizes
        while self._top not in sizes:
            self._top -= 1
        return next(iter(sizes[self._top]))

    def failed(self, peer: Peer, w: WriteHeader) -> None:
        """The claimed frame did not land (refused, or its link closed): a retry may."""
        assert w.wid is not None
        self._landing.pop((peer, (w.wid, w.part)), None)

    def _expire(self, peer: Peer, table: OrderedDict[Key, tuple[float, int]]) -> None:
        cut = self._clock() - self.ttl_s
        had = len(table)
        while table:
            k, (t, _) = next(iter(table.items()))
            if t >= cut:
                self._resized(peer, had, len(table))
                return
            del table[k]
            self._total -= 1
        self._resized(peer, had, 0)
        del self._applied[peer]
