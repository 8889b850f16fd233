"""A worker: one thread with its own uvloop loop, pinned, for one domain group.

The daemon's loop hands work over with :meth:`Worker.call`, a thread-safe
call on the worker's loop.  The queue is bounded: a transfer takes one of
``capacity`` slots (:meth:`take`) and its end gives it back (:meth:`release`);
when none is free the submitter awaits :meth:`wait_slot`, so a client that
submits faster than the wire drains is slowed down, not buffered without end.
Slots are counted on the daemon's loop only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .affinity import pin_current_thread

log = logging.getLogger("transferd.workers")
T = TypeVar("T")

DEFAULT_CAPACITY = 4096


class Worker:
    def __init__(self, name: str, cpu: int | None = None, capacity: int = DEFAULT_CAPACITY) -> None:
        self.name = name
        self.cpu = cpu
        self.pinned = False
        self.capacity = capacity
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._in_flight = 0
        self._waiters: list[asyncio.Future[None]] = []
        # When the worker's loop last ran a heartbeat (the watchdog's: a hung
        # worker stops systemd's pings).
        self.last_beat = time.monotonic()

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(10)
        if self.loop is None:
            raise RuntimeError(f"worker {self.name} failed to start")

    def _main(self) -> None:
        import uvloop

        if self.cpu is not None:
            # Pin before the loop and its structures exist, so their memory
            # comes from the node this core belongs to.
            self.pinned = pin_current_thread(self.cpu)
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        self.loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def beat(self) -> None:
        """Ask the worker's loop to note that it still runs (from any thread)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._beat)

    def _beat(self) -> None:
        self.last_beat = time.monotonic()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run_sync(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run ``fn`` on the worker's loop and wait for its result (set-up only)."""
        async def call() -> T:
            return fn()
        return self.run(call()).result(timeout)

    def has_slot(self) -> bool:
        return self._in_flight < self.capacity

    def take(self) -> None:
        self._in_flight += 1

    def release(self) -> None:
        self._in_flight -= 1
        while self._waiters and self.has_slot():
            w = self._waiters.pop(0)
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

    def stop(self) -> None:
        if self.loop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
