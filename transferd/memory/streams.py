"""Device streams and events, as the staging pipeline sees them.

A device copies bytes asynchronously, in stream order, and says when it is
done through events.  The pipeline (``staging.py``) and event-gated counting
only ever talk to a :class:`DeviceStream`: enqueue a copy (device to host,
host to device, device to device, all by address), record an event, and
learn when that event completed.  ``cuda.py`` implements it over a CuPy
stream; ``tests/standin_stream.py`` over a host thread (tests only: it is
never offered as a device).

Completion is learned by an :class:`EventWaiter`: one thread per stream that
blocks on its events in the order they were recorded (a stream is in order,
so the first event not done is the one to wait for) and hands each callback
on.  Nothing polls a device from the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

log = logging.getLogger("transferd.memory.streams")


class DeviceEvent(ABC):
    """A point in a stream: done once every copy enqueued before it has completed."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the event completed (never blocks)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread (only) until the event completed."""


class DeviceStream(ABC):
    """An in-order queue of asynchronous copies on one device.

    Addresses are plain integers: device pointers, and the addresses of
    pinned host staging (``StagingChunk.ptr``).  Every method only enqueues
    and returns at once; bounds were checked by the caller.
    """

    name: str = "stream"

    @abstractmethod
    def copy_d2h(self, host_ptr: int, dev_ptr: int, nbytes: int) -> None: ...

    @abstractmethod
    def copy_h2d(self, dev_ptr: int, host_ptr: int, nbytes: int) -> None: ...

    @abstractmethod
    def copy_d2d(self, dst_ptr: int, src_ptr: int, nbytes: int) -> None: ...

    @abstractmethod
    def fill(self, dev_ptr: int, value: int, nbytes: int) -> None: ...

    @abstractmethod
    def record(self) -> DeviceEvent:
        """An event after everything enqueued so far."""

    def synchronize(self) -> None:
        self.record().synchronize()

    def synchronize_device(self) -> None:
        """Wait for everything on the whole device (a GPU: cudaDeviceSynchronize)."""
        self.synchronize()

    def waiter_init(self) -> None:  # noqa: B027 - optional hook
        """Called once on the waiter's thread (CUDA makes its device current there)."""


# Events waited on at once per stream.  Each holds a staging chunk (or one
# landing peer write), so the staging pool bounds it well before this does.
MAX_WAITING = 65536


class EventWaiter:
    """One thread that waits on a stream's events in order and runs their callbacks.

    Callbacks run on the waiter's thread: they must be short and thread
    safe (the asyncio helper :meth:`wait` hands over with
    ``call_soon_threadsafe``).  A callback that raises is logged.
    """

    def __init__(self, stream: DeviceStream, name: str = "transferd-events") -> None:
        self.stream = stream
        self._q: queue.Queue[tuple[DeviceEvent, Callable[[], None]] | None] = queue.Queue(
            MAX_WAITING)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = False
        self._lock = threading.Lock()

    def _start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()

    def _main(self) -> None:
        try:
            self.stream.waiter_init()
        except Exception:  # pragma: no cover - only a broken device gets here
            log.exception("event waiter of %s could not start", self.stream.name)
        while True:
            item = self._q.get()
            if item is None:
                return
            event, callback = item
            try:
                event.synchronize()
            except Exception:  # a failed device copy: the callback still runs
                log.exception("waiting on an event of %s failed", self.stream.name)
            try:
                callback()
            except Exception:
                log.exception("event callback failed")

    def watch(self, event: DeviceEvent, callback: Callable[[], None]) -> None:
        """Run ``callback`` (on the waiter's thread) once ``event`` completed."""
        self._start()
        try:
            self._q.put_nowait((event, callback))
        except queue.Full:
            raise RuntimeError(
                f"more than {MAX_WAITING} events waited on {self.stream.name}") from None

    def wait(self, event: DeviceEvent) -> asyncio.Future[None]:
        """A future of the running loop that resolves once ``event`` completed."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if event.done():
            fut.set_result(None)
            return fut

        def settle() -> None:
            if not fut.done():
                fut.set_result(None)

        def hand_over() -> None:
            # The loop may have closed meanwhile: then nobody is waiting.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle)

        self.watch(event, hand_over)
        return fut

    def close(self) -> None:
        with self._lock:
            started = self._started
        if started:
            self._q.put(None)
            self._thread.join(5)
