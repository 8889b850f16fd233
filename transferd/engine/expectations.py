"""Expectations (EXPECT_IMM_COUNT): what each connection waits for on the ImmCounter.

An expectation belongs to the connection that registered it (at most
engine.max_expectations each) and goes away with it; it fires on the daemon's loop once
its immediate reaches its count (:class:`~.immcounter.ImmCounter` consumes the count).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from transferd.protocol.errors import OverLimit

from .immcounter import ImmCounter

Handle = Callable[[], None]


class Expectations:
    def __init__(self, counter: ImmCounter, limit: int) -> None:
        self.counter = counter
        self.limit = limit
        self._of: dict[Hashable, set[Handle]] = {}

    def expect(self, owner: Hashable, imm: int, count: int, callback: Handle) -> Handle:
        """``callback`` once ``imm`` reaches ``count``; the handle, for :meth:`cancel`."""
        mine = self._of.setdefault(owner, set())
        if len(mine) >= self.limit:
            raise OverLimit(f"{len(mine)} expectations already wait on this connection "
                            f"(engine.max_expectations = {self.limit})")

        def fired() -> None:
            mine.discard(fired)
            callback()

        mine.add(fired)
        self.counter.expect(imm, count, fired)
        return fired

    def pending(self) -> int:
        """Expectations clients wait on now (for the metrics)."""
        return sum(len(v) for v in list(self._of.values()))

    def cancel(self, owner: Hashable, handle: Handle) -> bool:
        """Drop a waiting expectation (nothing consumed); False if it had fired."""
        mine = self._of.get(owner)
        if mine is None or handle not in mine:
            return False
        if not self.counter.cancel(handle):
            return False  # reached meanwhile: its callback is on its way
        mine.discard(handle)
        return True

    def closed(self, owner: Hashable) -> None:
        """``owner``'s connection is gone: its expectations go, nothing consumed."""
        for cb in self._of.pop(owner, []):
            self.counter.cancel(cb)
