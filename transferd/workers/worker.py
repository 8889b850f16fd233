"""Workers: where a domain group's sockets and timers run.

A :class:`Worker` is the event loop one :class:`~transferd.domains.group.DomainGroup`
lives on.  The engine hands it work with :meth:`Worker.call` (from the
daemon's loop) and runs set-up on it with :meth:`Worker.run`; the group's
Domains register their sockets with :attr:`Worker.loop`.  Two kinds:

- :class:`LoopWorker` is the daemon's own loop.  A call is a plain call, a
  completion a plain call back: no thread hand-off and no wake-up between
  the client's frame and the peer's socket.  The host group's default
  (``engine.worker = "auto"``): on this project's measurements the two
  hand-offs of a thread worker cost more than the thread buys (docs/benchmarks.md,
  "Issue 12").
- :class:`ThreadWorker` is a thread of its own with its own uvloop loop,
  pinned to a core (of the device's NUMA node, for a GPU group), so its
  memory and its interrupts stay on that node.  Every call and every
  completion crosses threads (``call_soon_threadsafe``: a write to the
  loop's wake-up fd).

Both keep :attr:`Worker.last_beat`, which the systemd watchdog reads.
"""

from __future__ import annotations

import abc
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

KINDS = ("auto", "loop", "thread")


class Worker(abc.ABC):
    """The loop a domain group runs on (see the module's doc)."""

    # Whether :attr:`loop` is the daemon's own loop (calls are plain calls).
    on_daemon_loop = False

    def __init__(self, name: str, cpu: int | None = None) -> None:
        self.name = name
        self.cpu = cpu
        self.pinned = False
        self.loop: asyncio.AbstractEventLoop | None = None
        # When the worker's loop last ran a heartbeat (the watchdog's: a hung
        # worker stops systemd's pings).
        self.last_beat = time.monotonic()

    @property
    def kind(self) -> str:
        return "loop" if self.on_daemon_loop else "thread"

    @abc.abstractmethod
    def start(self) -> None:
        """Make :attr:`loop` usable (a thread worker starts its thread)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the worker's loop if it owns one (idempotent)."""

    @abc.abstractmethod
    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the worker's loop (called from the daemon's loop)."""

    def beat(self) -> None:
        """Ask the worker's loop to note that it still runs (from any thread)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._beat)

    def _beat(self) -> None:
        self.last_beat = time.monotonic()

    def run(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the worker's loop; its result as a thread-safe future."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run_sync(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run ``fn`` on the worker's loop and wait for its result (set-up only)."""
        async def call() -> T:
            return fn()
        return self.run(call()).result(timeout)


class ThreadWorker(Worker):
    """A thread of its own with its own uvloop loop, pinned to ``cpu`` when given."""

    def __init__(self, name: str, cpu: int | None = None) -> None:
        super().__init__(name, cpu)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._failed: BaseException | None = None
        self._new_loop: Callable[[], asyncio.AbstractEventLoop] | None = None

    def start(self) -> None:
        # Imported here, in the caller's thread: a missing uvloop is its own
        # ImportError at once, not a worker that "failed to start" 10 s later.
        import uvloop

        self._new_loop = uvloop.new_event_loop
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"worker {self.name} did not start in 10 s")
        if self._failed is not None:
            raise RuntimeError(f"worker {self.name} failed to start: "
                               f"{type(self._failed).__name__}: {self._failed}") \
                from self._failed

    def _main(self) -> None:
        try:
            if self.cpu is not None:
                # Pin before the loop and its structures exist, so their memory
                # comes from the node this core belongs to.
                self.pinned = pin_current_thread(self.cpu)
            assert self._new_loop is not None
            loop = self._new_loop()
            asyncio.set_event_loop(loop)
            self.loop = loop
        except BaseException as exc:
            self._failed = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        if self.loop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread.is_alive():
            self._thread.join(5)


class LoopWorker(Worker):
    """The daemon's own loop as a group's worker: no thread, no hand-off.

    :meth:`call` from the loop's thread runs ``fn`` at once, on the caller's
    stack (a submit's parts are on the socket before the handler returns);
    from any other thread it is scheduled with ``call_soon_threadsafe``.
    """

    on_daemon_loop = True

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(name, None)
        self.loop = loop
        self._thread_id: int | None = None

    def start(self) -> None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        # start() runs on the loop (the engine starts from it): this is its thread.
        self._thread_id = threading.get_ident()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self.loop is not None
        if threading.get_ident() == self._thread_id:
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def run_sync(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        if threading.get_ident() == self._thread_id:
            return fn()  # waiting on our own loop would never end
        return super().run_sync(fn, timeout)

    def stop(self) -> None:
        pass  # the loop is the daemon's: it stops with the daemon


def make_worker(kind: str, name: str, cpu: int | None) -> Worker:
    """A worker of ``kind`` ("loop" or "thread"; "auto" is resolved by the caller)."""
    if kind == "loop":
        return LoopWorker(name)
    if kind == "thread":
        return ThreadWorker(name, cpu)
    raise ValueError(f"unknown worker kind {kind!r} (have {', '.join(KINDS[1:])})")
