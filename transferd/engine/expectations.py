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


class _Fired:
    """An expectation's handle, called when it fires. An object, not a closure: a
    closure that names itself (to leave its connection's set) is a cycle per
    expectation, which only the collector frees; 65,536 of a closing connection left
    1.9 million objects to a 2 s pass of it, every client waiting."""

    __slots__ = ("__weakref__", "callback", "owner", "table")

    def __init__(self, table: Expectations, owner: Hashable, callback: Handle) -> None:
        self.table = table
        self.owner = owner
        self.callback = callback

    def __call__(self) -> None:
        self.table._forget(self)
        self.callback()


class Expectations:
    def __init__(self, counter: ImmCounter, limit: int, total_limit: int = 1 << 17) -> None:
        self.counter = counter
        self.limit = limit
        # All connections together: each expectation costs the daemon some 4 KiB, and a
        # client may open connection after connection (4 at ``limit``: +1 GiB).
        self.total_limit = total_limit
        self._of: dict[Hashable, set[Handle]] = {}
        self._total = 0  # len of every set in _of, kept (a sum per EXPECT is O(owners))

    def expect(self, owner: Hashable, imm: int, count: int, callback: Handle) -> Handle:
        """``callback`` once ``imm`` reaches ``count``; the handle, for :meth:`cancel`."""
        mine = self._of.get(owner)
        if mine is not None and len(mine) >= self.limit:
            raise OverLimit(f"{len(mine)} expectations already wait on this connection "
                            f"(engine.max_expectations = {self.limit})")
        if self._total >= self.total_limit:
            raise OverLimit(f"{self._total} expectations already wait on this daemon, all "
                            "connections together (engine.max_expectations_total = "
                            f"{self.total_limit})")
        if mine is None:
            mine = self._of[owner] = set()
        fired = _Fired(self, owner, callback)
        mine.add(fired)
        self._total += 1
        try:
            self.counter.expect(imm, count, fired)
        except BaseException:
            self._forget(fired)
            raise
        return fired

    def _forget(self, handle: _Fired) -> None:
        """``handle`` waits no more (it fired, or was never taken)."""
        mine = self._of.get(handle.owner)
        if mine is not None and handle in mine:
            mine.discard(handle)
            self._total -= 1

    def waiting(self, owner: Hashable, handle: Handle) -> bool:
        mine = self._of.get(owner)
        return mine is not None and handle in mine

    def of(self, owner: Hashable) -> list[Handle]:
        """``owner``'s expectations still waiting."""
        return list(self._of.get(owner, ()))

    def pending(self) -> int:
        """Expectations clients wait on now (for the metrics)."""
        return self._total

    def cancel(self, owner: Hashable, handle: Handle) -> bool:
        """Drop a waiting expectation (nothing consumed); False if it had fired."""
        mine = self._of.get(owner)
        if mine is None or handle not in mine:
            return False
        if not self.counter.cancel(handle):
            return False  # reached meanwhile: its callback is on its way
        mine.discard(handle)
        self._total -= 1
        return True

    def closed(self, owner: Hashable) -> None:
        """``owner``'s connection is gone: its expectations go, nothing consumed."""
        mine = self._of.pop(owner, set())
        self._total -= len(mine)
        handles = list(mine)
        mine.clear()  # one firing meanwhile (its cancel lost the race) counts nothing again
        for cb in handles:
            self.counter.cancel(cb)
