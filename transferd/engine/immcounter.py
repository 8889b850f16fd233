"""ImmCounter: completion on the receiver that never depends on delivery order.

A write carrying immediate ``imm`` adds to that immediate's counter once its
bytes are in place; ``expect(imm, count)`` fires when the counter reaches
``count`` and then consumes ``count`` from it, so the same immediate can be
reused round after round (layer after layer of a KV cache).  An expectation
registered after the writes landed fires at once.  Counters of different
immediates are independent.

``add`` is called from worker threads, ``expect`` from the daemon's loop; one
lock guards both, and callbacks run outside it through ``notify`` (``expect``: an
expectation that is met already fires later, never within the call) or ``now``
(``add``: what a landing reached may fire within its call, where the caller's thread
may run it).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

Notify = Callable[[Callable[[], None]], None]


@dataclass(slots=True)
class Expectation:
    imm: int
    count: int
    callback: Callable[[], None]
    key: int = 0


class ImmCounter:
    """Counters and the expectations waiting on them.

    Each immediate's expectations are an OrderedDict (insertion order is the
    order served; removing any one is O(1)), and every expectation is found by
    its callback, so dropping a closed connection's n expectations is O(n),
    not a scan of every waiting expectation per one (which was quadratic).
    """

    def __init__(self, notify: Notify | None = None, now: Notify | None = None,
                 max_counters: int = 1 << 20) -> None:
        self._counts: defaultdict[int, int] = defaultdict(int)
        # engine.max_counters: the counts held (nonzero, nobody consumed them yet).
        self.max_counters = max_counters
        self._waiting: dict[int, OrderedDict[int, Expectation]] = {}
        self._by_callback: dict[Callable[[], None], list[Expectation]] = {}
        self._keys = itertools.count(1)
        self._lock = threading.Lock()
        # How a fired callback is run: directly, or handed to another loop.
        self._notify: Notify = notify or (lambda fn: fn())
        # How what an add() reached is run (default: as expect()'s).
        self._now: Notify = now or self._notify

    def value(self, imm: int) -> int:
        with self._lock:
            return self._counts.get(imm, 0)

    def room(self, imm: int) -> bool:
        """Whether a write with ``imm`` may land: its count is held already, an
        expectation waits on it (its count is consumed as it lands), or there is room
        for one more count (engine.max_counters).  Asked before a write's bytes land,
        so the table holds at most the cap plus the writes landing meanwhile."""
        counts = self._counts
        if imm in counts or len(counts) < self.max_counters:
            return True
        with self._lock:
            return imm in self._counts or imm in self._waiting \
                or len(self._counts) < self.max_counters

    def held(self) -> int:
        """How many immediates have a count held (engine.max_counters bounds them)."""
        return len(self._counts)

    def pending(self) -> int:
        """How many expectations wait (all immediates)."""
        with self._lock:
            return sum(len(q) for q in self._waiting.values())

    def add(self, imm: int, n: int = 1) -> int:
        """Add ``n`` to ``imm``'s counter; how many expectations that met."""
        with self._lock:
            if n:
                self._counts[imm] += n
            fired = self._fire(imm)
        for e in fired:
            self._now(e.callback)
        return len(fired)

    def expect(self, imm: int, count: int, callback: Callable[[], None]) -> None:
        if count <= 0:
            self._notify(callback)
            return
        with self._lock:
            e = Expectation(imm, count, callback, next(self._keys))
            q = self._waiting.get(imm)
            if q is None:
                q = self._waiting[imm] = OrderedDict()
            q[e.key] = e
            self._by_callback.setdefault(callback, []).append(e)
            fired = self._fire(imm)
        for f in fired:
            self._notify(f.callback)

    def _fire(self, imm: int) -> list[Expectation]:
        # Expectations on one immediate are served in the order registered.
        q = self._waiting.get(imm)
        fired: list[Expectation] = []
        if q is None:
            return fired
        counts = self._counts
        have = counts.get(imm, 0)
        while q:
            e = next(iter(q.values()))
            if have < e.count:
                break
            q.popitem(last=False)
            have -= e.count
            self._forget(e)
            fired.append(e)
        if not q:
            del self._waiting[imm]
        # A counter at 0 is no counter: kept, every immediate ever used once would stay.
        if have:
            counts[imm] = have
        else:
            counts.pop(imm, None)
        return fired

    def _forget(self, e: Expectation) -> None:
        mine = self._by_callback.get(e.callback)
        if mine is None:
            return
        if len(mine) == 1:
            del self._by_callback[e.callback]
        else:
            mine.remove(e)  # a callback shared by several expectations: rare, short lists

    def cancel(self, callback: Callable[[], None]) -> int:
        """Drop every expectation with this callback (its client went away): O(its count)."""
        with self._lock:
            mine = self._by_callback.pop(callback, [])
            for e in mine:
                q = self._waiting.get(e.imm)
                if q is None:
                    continue
                q.pop(e.key, None)
                if not q:
                    del self._waiting[e.imm]
        return len(mine)
