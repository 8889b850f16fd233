"""A call run on a rail's worker loop and waited for, with a deadline, from another thread.

Memory registration comes from the daemon's loop, but a NIC's registration table belongs
to its rail's worker, so ``register`` runs there and its caller waits.  ``ibv_reg_mr``
pins every page and can take long for a large region; the caller stops waiting after
its timeout, and then what the worker does later must not stay behind: a registration
that completes after its caller gave up is undone on the worker at once (it would be
pinned memory with no region), and one that had not started yet never starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import threading
from collections.abc import Callable
from typing import Generic, TypeVar, cast

from transferd.protocol.errors import Timeout

T = TypeVar("T")


class CallState(enum.Enum):
    WAITING = "waiting"  # not run yet, or running
    DONE = "done"  # ran and its caller took (or will take) the result
    ABANDONED = "abandoned"  # the caller gave up: a late result is undone


class WorkerCall(Generic[T]):
    """One call of ``fn`` on ``loop``; ``undo(result)`` reverses a result nobody takes."""

    def __init__(self, fn: Callable[[], T], undo: Callable[[T], None] | None) -> None:
        self._fn = fn
        self._undo = undo
        self._lock = threading.Lock()
        self.state = CallState.WAITING
        self.undone = False

    def run(self) -> T | None:
        """On the worker loop."""
        with self._lock:
            if self.state is CallState.ABANDONED:
                return None  # its caller left before it started: nothing to do
        result = self._fn()
        with self._lock:
            if self.state is CallState.WAITING:
                self.state = CallState.DONE
                return result
        # The caller gave up while it ran: nobody will use what it made.
        if self._undo is not None:
            self._undo(result)
        self.undone = True
        return None

    def abandon(self) -> bool:
        """The caller's deadline passed: True when the call had not completed (its
        result, if it comes, will be undone), False when it completed just now."""
        with self._lock:
            if self.state is CallState.DONE:
                return False
            self.state = CallState.ABANDONED
            return True


def call_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], T], *,
                 timeout: float, what: str, undo: Callable[[T], None] | None = None) -> T:
    """``fn()`` on ``loop`` (directly when that is the running loop or it does not run),
    waited for at most ``timeout`` seconds: Timeout past it, and a late result undone."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop or not loop.is_running():
        return fn()
    call = WorkerCall(fn, undo)

    async def on_worker() -> T | None:
        return call.run()

    fut = asyncio.run_coroutine_threadsafe(on_worker(), loop)
    try:
        result = fut.result(timeout)
    except concurrent.futures.TimeoutError:
        if call.abandon():
            raise Timeout(f"{what} took over {timeout:g} s; given up (undone when it "
                          "completes)") from None
        result = fut.result()  # it completed as the deadline passed: taken
    return cast(T, result)
