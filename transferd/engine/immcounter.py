"""ImmCounter: completion on the receiver that never depends on delivery order.

A write carrying immediate ``imm`` adds to that immediate's counter once its
bytes are in place; ``expect(imm, count)`` fires when the counter reaches
``count`` and then consumes ``count`` from it, so the same immediate can be
reused round after round (layer after layer of a KV cache).  An expectation
registered after the writes landed fires at once.  Counters of different
immediates are independent.

``add`` is called from worker threads, ``expect`` from the daemon's loop; one
lock guards both, and callbacks run outside it through ``notify``.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

Notify = Callable[[Callable[[], None]], None]


@dataclass(slots=True)
class Expectation:
    imm: int
    count: int
    callback: Callable[[], None]


class ImmCounter:
    def __init__(self, notify: Notify | None = None) -> None:
        self._counts: defaultdict[int, int] = defaultdict(int)
        self._waiting: defaultdict[int, deque[Expectation]] = defaultdict(deque)
        self._lock = threading.Lock()
        # How a fired callback is run: directly, or handed to another loop.
        self._notify: Notify = notify or (lambda fn: fn())

    def value(self, imm: int) -> int:
        with self._lock:
            return self._counts.get(imm, 0)

    def add(self, imm: int, n: int = 1) -> None:
        with self._lock:
            self._counts[imm] += n
            fired = self._fire(imm)
        for e in fired:
            self._notify(e.callback)

    def expect(self, imm: int, count: int, callback: Callable[[], None]) -> None:
        if count <= 0:
            self._notify(callback)
            return
        with self._lock:
            self._waiting[imm].append(Expectation(imm, count, callback))
            fired = self._fire(imm)
        for e in fired:
            self._notify(e.callback)

    def _fire(self, imm: int) -> list[Expectation]:
        # Expectations on one immediate are served in the order registered.
        q = self._waiting.get(imm)
        fired: list[Expectation] = []
        while q and self._counts[imm] >= q[0].count:
            e = q.popleft()
            self._counts[imm] -= e.count
            fired.append(e)
        if q is not None and not q:
            del self._waiting[imm]
        return fired

    def cancel(self, callback: Callable[[], None]) -> int:
        """Drop every expectation with this callback (its client went away)."""
        n = 0
        with self._lock:
            for imm in list(self._waiting):
                q = self._waiting[imm]
                kept = deque(e for e in q if e.callback is not callback)
                n += len(q) - len(kept)
                if kept:
                    self._waiting[imm] = kept
                else:
                    del self._waiting[imm]
        return n
