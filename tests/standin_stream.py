"""A host stand-in for a device stream: TESTS ONLY, never offered as a device.

``StandinStream`` is an in-order executor (one thread) of the copies a
:class:`~transferd.memory.streams.DeviceStream` takes, with events that are
set when the executor reaches them.  "Device memory" is host memory
(:class:`StandinDeviceMemory`) that the code under test only reaches through
the stream, as it would a GPU's.  Tests can hold the stream (``hold()`` /
``resume()``) to prove that something waits for an event, and slow every
copy (``delay_s``) to prove that copies overlap sends.  Every operation is
logged with its start and end, in order.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from transferd.memory.streams import DeviceEvent, DeviceStream


class StandinEvent(DeviceEvent):
    def __init__(self) -> None:
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        # Bounded: a test that forgets to resume a held stream fails, not hangs.
        if not self._done.wait(30):
            raise TimeoutError("stand-in event not reached in 30 s")


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

    def host_array(self) -> np.ndarray:
        """For the test's own checks only (a GPU test would copy back instead)."""
        return np.frombuffer(self._mem, dtype=np.uint8, count=self.size)


class StandinStream(DeviceStream):
    def __init__(self, name: str = "standin", delay_s: float = 0.0,
                 hold_path: str | None = None) -> None:
        self.name = name
        self.delay_s = delay_s
        # While this file exists the stream is held (a test holds another process's stream).
        self.hold_path = hold_path
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

    def _op(self, op: str, nbytes: int, fn: Callable[[], None]) -> None:
        def run() -> None:
            start = time.monotonic()
            if self.delay_s:
                time.sleep(self.delay_s)
            fn()
            self.log.append(LogEntry(op, nbytes, start, time.monotonic()))

        self._q.put_nowait(run)

    def copy_d2h(self, host_ptr: int, dev_ptr: int, nbytes: int) -> None:
        self._op("d2h", nbytes, lambda: ctypes.memmove(host_ptr, dev_ptr, nbytes))

    def copy_h2d(self, dev_ptr: int, host_ptr: int, nbytes: int) -> None:
        self._op("h2d", nbytes, lambda: ctypes.memmove(dev_ptr, host_ptr, nbytes))

    def copy_d2d(self, dst_ptr: int, src_ptr: int, nbytes: int) -> None:
        self._op("d2d", nbytes, lambda: ctypes.memmove(dst_ptr, src_ptr, nbytes))

    def fill(self, dev_ptr: int, value: int, nbytes: int) -> None:
        self._op("fill", nbytes, lambda: ctypes.memset(dev_ptr, value, nbytes))

    def record(self) -> StandinEvent:
        ev = StandinEvent()
        self._q.put_nowait(ev._done.set)
        return ev

    def hold(self) -> None:
        """Stop executing (what is queued waits) until :meth:`resume`."""
        self._run.clear()

    def resume(self) -> None:
        self._run.set()

    def close(self) -> None:
        self._run.set()
        self._q.put(None)
        self._thread.join(5)
