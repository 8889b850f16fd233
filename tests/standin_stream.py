"""A host stand-in for a device stream: TESTS ONLY, never offered as a device.

``StandinStream`` is an in-order executor (one thread) of the copies a
:class:`~transferd.memory.streams.DeviceStream` takes, with events that are
set when the executor reaches them.  "Device memory" is host memory
(:class:`StandinDeviceMemory`) that the code under test only reaches through
the stream, as it would a GPU's.  Tests can hold the stream (``hold()`` /
``resume()``) to prove that something waits for an event, and slow every
copy (``delay_s``) to prove that copies overlap sends.  Every operation is
logged with its start and end, in order.

Two ways to make it fail as a GPU would:

- a fault (``fail()`` / ``heal()``, or a file at ``fault_path`` while it
  exists): the copies it reaches do not run and the events it reaches report
  a :class:`~transferd.memory.streams.DeviceFault`, as CUDA reports a failed
  copy through the next event;
- ``strict=True``: a copy whose host side is not pinned staging (``pin()``),
  or whose device side is not stand-in device memory, is refused the same
  way and noted in ``violations``.  A real ``cudaMemcpyAsync`` from or into
  pageable host memory is synchronous: it would have held the caller (the
  daemon's event loop) until done.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from transferd.memory.staging import StagingPool
from transferd.memory.streams import DeviceEvent, DeviceFault, DeviceStream


class StandinEvent(DeviceEvent):
    def __init__(self) -> None:
        self._done = threading.Event()
        self.fault: str | None = None

    def done(self) -> bool:
        if self._done.is_set() and self.fault is not None:
            raise DeviceFault(self.fault)
        return self._done.is_set()

    def synchronize(self) -> None:
        # Bounded: a test that forgets to resume a held stream fails, not hangs.
        if not self._done.wait(30):
            raise TimeoutError("stand-in event not reached in 30 s")
        if self.fault is not None:
            raise DeviceFault(self.fault)


# Live stand-in device allocations: [start, end) by id (what strict streams accept).
_DEVICE: dict[int, tuple[int, int]] = {}


@dataclass
class LogEntry:
    op: str
    nbytes: int
    start: float
    end: float


class StandinDeviceMemory:
    """Host memory playing device memory: an address and a size, no view for the code."""

    def __init__(self, size: int) -> None:
        self._mem = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.size = size
        self.ptr = int(np.frombuffer(self._mem, dtype=np.uint8).ctypes.data)
        _DEVICE[id(self)] = (self.ptr, self.ptr + max(size, 1))
        weakref.finalize(self, _DEVICE.pop, id(self), None)

    def host_array(self) -> np.ndarray:
        """For the test's own checks only (a GPU test would copy back instead)."""
        return np.frombuffer(self._mem, dtype=np.uint8, count=self.size)


class StandinStream(DeviceStream):
    def __init__(self, name: str = "standin", delay_s: float = 0.0,
                 hold_path: str | None = None, fault_path: str | None = None,
                 strict: bool = False) -> None:
        self.name = name
        self.delay_s = delay_s
        # While this file exists the stream is held (a test holds another process's stream).
        self.hold_path = hold_path
        # While this file exists every copy fails (a test breaks another process's device).
        self.fault_path = fault_path
        self.strict = strict
        self.pinned: list[tuple[int, int]] = []
        self.violations: list[str] = []
        # A fault reached and not yet reported by an event.
        self._fault: str | None = None
        self._failing = False
        self.log: list[LogEntry] = []
        self._q: queue.Queue[Callable[[], None] | None] = queue.Queue(4096)
        self._run = threading.Event()
        self._run.set()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            self._run.wait(30)
            if self.hold_path:
                deadline = time.monotonic() + 30  # bounded, as hold() is
                while os.path.exists(self.hold_path) and time.monotonic() < deadline:
                    time.sleep(0.002)
            item()

    def _op(self, op: str, nbytes: int, fn: Callable[[], None],
            refused: str | None = None) -> None:
        def run() -> None:
            start = time.monotonic()
            if self.delay_s:
                time.sleep(self.delay_s)
            failing = self._failing or (self.fault_path and os.path.exists(self.fault_path))
            if refused is not None:
                self.violations.append(refused)
                self._fault = self._fault or refused
            elif failing:
                self._fault = self._fault or f"{self.name}: injected fault in a {op} copy"
            else:
                fn()
            self.log.append(LogEntry(op, nbytes, start, time.monotonic()))

        self._q.put_nowait(run)

    # -- what a strict stream accepts -------------------------------------------------

    def pin(self, pool: StagingPool) -> StagingPool:
        """Take ``pool``'s chunks as pinned host memory (a strict stream copies only those)."""
        self.pinned += [(c.ptr, c.ptr + c.size) for c in pool._chunks]
        return pool

    def _refused(self, op: str, host: int | None, devs: tuple[int, ...], n: int) -> str | None:
        if not self.strict or not n:
            return None
        if host is not None and not any(lo <= host and host + n <= hi for lo, hi in self.pinned):
            return (f"{self.name}: a {op} copy of {n} bytes from or into host memory 0x{host:x} "
                    "that is not pinned staging (a GPU would have run it synchronously)")
        for d in devs:
            if not any(lo <= d and d + n <= hi for lo, hi in list(_DEVICE.values())):
                return f"{self.name}: a {op} of {n} bytes at 0x{d:x}, which is not device memory"
        return None

    def copy_d2h(self, host_ptr: int, dev_ptr: int, nbytes: int) -> None:
        self._op("d2h", nbytes, lambda: ctypes.memmove(host_ptr, dev_ptr, nbytes),
                 self._refused("d2h", host_ptr, (dev_ptr,), nbytes))

    def copy_h2d(self, dev_ptr: int, host_ptr: int, nbytes: int) -> None:
        self._op("h2d", nbytes, lambda: ctypes.memmove(dev_ptr, host_ptr, nbytes),
                 self._refused("h2d", host_ptr, (dev_ptr,), nbytes))

    def copy_d2d(self, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        self._op("d2d", nbytes, lambda: ctypes.memmove(dst_ptr, src_ptr, nbytes),
                 self._refused("d2d", None, (dst_ptr, src_ptr), nbytes))

    def fill(self, dev_ptr: int, value: int, nbytes: int) -> None:
        self._op("fill", nbytes, lambda: ctypes.memset(dev_ptr, value, nbytes),
                 self._refused("fill", None, (dev_ptr,), nbytes))

    def record(self) -> StandinEvent:
        ev = StandinEvent()

        def reached() -> None:
            # Like CUDA, the next event reports the failure of a copy before it.
            ev.fault, self._fault = self._fault, None
            ev._done.set()

        self._q.put_nowait(reached)
        return ev

    def fail(self) -> None:
        """Every copy from now on fails (until :meth:`heal`)."""
        self._failing = True

    def heal(self) -> None:
        self._failing = False

    def hold(self) -> None:
        """Stop executing (what is queued waits) until :meth:`resume`."""
        self._run.clear()

    def resume(self) -> None:
        self._run.set()

    def close(self) -> None:
        self._run.set()
        self._q.put(None)
        self._thread.join(5)
