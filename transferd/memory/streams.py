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

A device that reports an error (``cudaEventSynchronize`` failing, or
``cudaEventQuery`` returning an error status) makes the event fail with
:class:`DeviceFault`: every callback and awaiting future is told, so what
waited on the copy fails with a typed error and nothing counts, acknowledges
or sends bytes the copy never placed.

A :class:`DeviceStream` is also a context manager: ``with stream:`` makes it
the calling thread's current stream (:func:`current_stream`), as CuPy's
``with cupy.cuda.Stream():`` does for its own; the client's async copies take
the current stream of the thread that calls them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Literal

from transferd.protocol.errors import Internal

log = logging.getLogger("transferd.memory.streams")


class DeviceFault(Internal):
    """The device failed a copy (an error reported by its event): nothing it was to
    place is there.  Wire code INTERNAL (the daemon's device failed, not the request)."""


# What an event's callback is told: None, it completed; a DeviceFault, it failed.
Outcome = DeviceFault | None


class DeviceEvent(ABC):
    """A point in a stream: done once every copy enqueued before it has completed."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the event completed (never blocks); DeviceFault if it failed."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread (only) until the event completed; DeviceFault if
        the device reported an error."""

    def outcome(self) -> Outcome | Literal[False]:
        """False while pending, else how it ended (None: completed, or its DeviceFault)."""
        try:
            return None if self.done() else False
        except DeviceFault as exc:
            return exc


def settle(fut: asyncio.Future[None], outcome: Outcome) -> None:
    """Resolve ``fut`` with an event's outcome (on its loop), unless it ended already."""
    if fut.done():
        return
    if outcome is None:
        fut.set_result(None)
    else:
        fut.set_exception(outcome)


_current = threading.local()


def current_stream() -> DeviceStream | None:
    """The calling thread's stream, made current by ``with stream:`` (None outside)."""
    stack: list[DeviceStream] | None = getattr(_current, "stack", None)
    return stack[-1] if stack else None


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

    def __enter__(self) -> DeviceStream:
        stack = getattr(_current, "stack", None)
        if stack is None:
            stack = _current.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _current.stack.pop()


# Events waited on at once per stream.  Each holds a staging chunk (or one
# landing peer write), so the staging pool bounds it well before this does.
MAX_WAITING = 65536


class EventWaiter:
    """One thread that waits on events in order and runs their callbacks.

    Callbacks run on the waiter's thread and are told the event's outcome
    (None, or its DeviceFault): they must be short and thread safe (the
    asyncio helper :meth:`wait` hands over with ``call_soon_threadsafe``).
    A callback that raises is logged.  ``stream`` (optional) is the stream
    whose events it waits on: its ``waiter_init`` runs on the thread first.
    """

    def __init__(self, stream: DeviceStream | None = None,
                 name: str = "transferd-events") -> None:
        self.stream = stream
        self.name = name
        self._q: queue.Queue[tuple[DeviceEvent, Callable[[Outcome], None]] | None] = \
            queue.Queue(MAX_WAITING)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = False
        self._lock = threading.Lock()
        # Events given and not yet reported (for the bound on a client's waiters).
        self.waiting = 0

    def _start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._thread.start()

    def _main(self) -> None:
        if self.stream is not None:
            try:
                self.stream.waiter_init()
            except Exception:  # pragma: no cover - only a broken device gets here
                log.exception("event waiter of %s could not start", self.stream.name)
        while True:
            item = self._q.get()
            if item is None:
                return
            event, callback = item
            outcome: Outcome = None
            try:
                event.synchronize()
            except DeviceFault as exc:
                outcome = exc
            except Exception as exc:  # whatever the device library raised: a failed copy
                outcome = DeviceFault(f"{self.name}: waiting on an event failed: "
                                      f"{type(exc).__name__}: {exc}")
            if outcome is not None:
                log.error("%s", outcome.message)
            with self._lock:
                self.waiting -= 1
            try:
                callback(outcome)
            except Exception:
                log.exception("event callback failed")

    def watch(self, event: DeviceEvent, callback: Callable[[Outcome], None]) -> None:
        """Run ``callback(outcome)`` (on the waiter's thread) once ``event`` ended."""
        self._start()
        with self._lock:
            self.waiting += 1
        try:
            self._q.put_nowait((event, callback))
        except queue.Full:
            with self._lock:
                self.waiting -= 1
            raise RuntimeError(f"more than {MAX_WAITING} events waited on by "
                               f"{self.name}") from None

    def wait(self, event: DeviceEvent) -> asyncio.Future[None]:
        """A future of the running loop that resolves once ``event`` completed, or
        fails with its DeviceFault."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        ended = event.outcome()
        if ended is None:
            fut.set_result(None)
            return fut
        if isinstance(ended, DeviceFault):
            fut.set_exception(ended)
            return fut

        def hand_over(outcome: Outcome) -> None:
            # The loop may have closed meanwhile: then nobody is waiting.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, fut, outcome)

        self.watch(event, hand_over)
        return fut

    def close(self) -> None:
        with self._lock:
            started = self._started
        if started:
            self._q.put(None)
            self._thread.join(5)
