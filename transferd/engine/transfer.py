"""A transfer in flight: its parts, and who to tell when they are all done."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from transferd.protocol.errors import TransferdError


class Transfer:
    """Completes once every part was acknowledged (applied at the destination).

    The first failure fails the transfer; later acknowledgements are ignored.
    ``done`` is called exactly once, on the worker's loop.
    """

    __slots__ = ("_done", "error", "finished", "nbytes", "op", "remaining", "timer")

    def __init__(self, op: int, parts: int, nbytes: int,
                 done: Callable[[TransferdError | None], None]) -> None:
        self.op = op
        self.remaining = parts
        self.nbytes = nbytes
        self._done = done
        self.error: TransferdError | None = None
        self.finished = False
        # Cancelled when the transfer ends (a peer that hangs must not hang us).
        self.timer: asyncio.TimerHandle | None = None

    def _end(self, error: TransferdError | None) -> None:
        self.finished = True
        self.error = error
        if self.timer is not None:
            self.timer.cancel()
        self._done(error)

    def part_done(self, error: TransferdError | None = None) -> None:
        if self.finished:
            return
        if error is not None:
            self.fail(error)
            return
        self.remaining -= 1
        if self.remaining <= 0:
            self._end(None)

    def fail(self, error: TransferdError) -> None:
        if not self.finished:
            self._end(error)
