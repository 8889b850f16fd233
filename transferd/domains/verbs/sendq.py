"""A send queue's room, and batching ready work requests into doorbells.

A queue pair takes at most ``depth`` outstanding send work requests (its
``max_send_wr``); more wait here, in order, in a bounded deque.  :meth:`pump` hands
the poster up to the free room at once, which the poster cuts into chains of up to
CHAIN_MAX (one doorbell each).  Pure: the poster is a callable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from transferd.protocol.errors import BadRequest

T = TypeVar("T")

MAX_WAITING = 1 << 16


class SendQueue(Generic[T]):
    def __init__(self, depth: int, post: Callable[[Sequence[T]], None],
                 max_waiting: int = MAX_WAITING) -> None:
        self.depth = depth
        self.in_flight = 0
        self._post = post
        self._waiting: deque[T] = deque()
        self._max_waiting = max_waiting

    def submit(self, items: Sequence[T]) -> None:
        if len(self._waiting) + len(items) > self._max_waiting:
            raise BadRequest(f"send queue full ({self._max_waiting} work requests waiting)")
        self._waiting.extend(items)
        self.pump()

    def completed(self, n: int = 1) -> None:
        self.in_flight -= n
        self.pump()

    def pump(self) -> None:
        room = self.depth - self.in_flight
        if room <= 0 or not self._waiting:
            return
        batch = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        self.in_flight += len(batch)
        self._post(batch)

    def drain(self) -> list[T]:
        items = list(self._waiting)
        self._waiting.clear()
        return items

    @property
    def waiting(self) -> int:
        return len(self._waiting)
