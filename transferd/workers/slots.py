"""The engine's bounded queue of transfers in flight, counted on the daemon's loop.

A transfer takes one of ``capacity`` slots (:meth:`Slots.take`) and its end
gives it back (:meth:`Slots.release`); when none is free the submitter awaits
:meth:`Slots.wait_slot`, so a client that submits faster than the wire drains
is slowed down, not buffered without end.  One table for every domain group
of a daemon: the bound is the daemon's, whichever group a transfer runs on.
"""

from __future__ import annotations

import asyncio
from collections import deque

DEFAULT_CAPACITY = 4096


class Slots:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"slot capacity must be positive, not {capacity}")
        self.capacity = capacity
        self._in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def has_slot(self) -> bool:
        return self._in_flight < self.capacity

    def take(self) -> None:
        self._in_flight += 1

    def release(self) -> None:
        self._in_flight -= 1
        while self._waiters and self.has_slot():
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    async def wait_slot(self) -> None:
        while not self.has_slot():
            w = asyncio.get_running_loop().create_future()
            self._waiters.append(w)
            await w

    @property
    def in_flight(self) -> int:
        return self._in_flight
