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
from typing import Any

from transferd.protocol.errors import BadRequest, Timeout
from transferd.protocol.peer import WriteHeader

# Defaults of engine.write_id_window and engine.write_id_ttl_s.
WINDOW = 65536
TTL_S = 600.0
# Frames landing at once with an id (one per inbound link at a time; a bound anyway).
MAX_LANDING = 65536

Key = tuple[int, int, int, int]  # (peer node, peer group, wid, part)


class Seen(enum.Enum):
    NEW = "new"  # land it (claimed now: landed() or failed() must follow)
    APPLIED = "applied"  # acknowledge ok, place nothing, count nothing


def _what(w: WriteHeader) -> tuple[Any, ...]:
    # Not the rkey: a retry may go over another rail (the plan rotates rails by op),
    # and each rail has its own.  The absolute ranges name the destination.
    return (tuple(w.addrs), tuple(w.lens), w.imm, w.span)


class WriteIds:
    def __init__(self, window: int = WINDOW, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.ttl_s = ttl_s
        self._clock = clock
        self._applied: OrderedDict[Key, tuple[float, tuple[Any, ...]]] = OrderedDict()
        self._landing: dict[Key, tuple[Any, ...]] = {}
        self.duplicates = 0

    def configure(self, window: int, ttl_s: float, clock: Callable[[], float]) -> None:
        self.window, self.ttl_s, self._clock = window, ttl_s, clock

    def __len__(self) -> int:
        return len(self._applied)

    def _now(self) -> float:
        return self._clock()

    @staticmethod
    def key(peer: tuple[int, int], w: WriteHeader) -> Key:
        assert w.wid is not None
        return (peer[0], peer[1], w.wid, w.part)

    def claim(self, peer: tuple[int, int], w: WriteHeader) -> Seen:
        """Before a frame with a wid is placed: APPLIED (acknowledge it ok, do nothing)
        or NEW (claimed: call :meth:`applied` or :meth:`failed` after)."""
        k = self.key(peer, w)
        what = _what(w)
        self._expire()
        seen = self._applied.get(k)
        if seen is not None:
            if seen[1] != what:
                raise BadRequest(f"write id {w.wid} part {w.part} was applied with other "
                                 "contents (a write id names one write)")
            self.duplicates += 1
            return Seen.APPLIED
        landing = self._landing.get(k)
        if landing is not None:
            raise Timeout(f"write id {w.wid} part {w.part} is still landing from an earlier "
                          "attempt: outcome unknown, retry with the same id")
        if len(self._landing) >= MAX_LANDING:
            raise BadRequest(f"{MAX_LANDING} writes with ids are landing here at once")
        self._landing[k] = what
        return Seen.NEW

    def applied(self, peer: tuple[int, int], w: WriteHeader) -> None:
        """The claimed frame's bytes are in place (and counted, by the counting rules)."""
        k = self.key(peer, w)
        what = self._landing.pop(k, None)
        self._applied[k] = (self._now(), what if what is not None else _what(w))
        self._applied.move_to_end(k)
        while len(self._applied) > self.window:
            self._applied.popitem(last=False)

    def failed(self, peer: tuple[int, int], w: WriteHeader) -> None:
        """The claimed frame did not land (refused, or its link closed): a retry may."""
        self._landing.pop(self.key(peer, w), None)

    def _expire(self) -> None:
        if not self._applied:
            return
        cut = self._now() - self.ttl_s
        for _ in range(len(self._applied)):
            k, (t, _) = next(iter(self._applied.items()))
            if t >= cut:
                return
            del self._applied[k]
