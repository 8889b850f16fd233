"""Pinned host staging for device memory: one bounded, reused pool per group.

Device memory has no host view.  Bytes that cross the wire on their way to or
from a device go through staging: chunks of pinned host memory allocated
once, when the group starts, and reused.  When every chunk is taken, work
waits for one (back-pressure); the pool never grows.

The pipeline functions here move bytes between a device and the wire:

- :func:`device_to_wire` (a GET): the D2H copy of chunk k+1 is enqueued
  before chunk k is sent, so the device copies while the socket sends.
- :func:`wire_to_device` (a SET): a payload received into staging goes to
  the device by an async H2D copy; the caller learns when it is in place
  through the copy's event.
- :class:`GatedLanding` (the engine): an immediate is counted only after the
  device copy that lands its bytes completed (its event), never when the
  bytes reached staging.

They talk to a :class:`~transferd.memory.streams.DeviceStream` only, so they
are tested on any machine with the host stand-in of ``tests/``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import mmap
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transferd.protocol.errors import BadRequest

from .streams import DeviceStream, EventWaiter

DEFAULT_CHUNK = 4 << 20
DEFAULT_CHUNKS = 8


@dataclass(eq=False)
class StagingChunk:
    """One pinned chunk: a host view, its address (for the device), its pool."""

    index: int
    view: memoryview
    ptr: int
    keep: Any = field(repr=False, default=None)  # what owns the memory (mmap, CuPy pinned)

    @property
    def size(self) -> int:
        return len(self.view)


Allocator = Callable[[int], tuple[memoryview, int, Any]]


def host_allocator(size: int) -> tuple[memoryview, int, Any]:
    """Page-aligned anonymous host memory (stand-in staging, tests and dry runs)."""
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(mem)
    return view, int(np.frombuffer(view, dtype=np.uint8).ctypes.data), mem


class StagingPool:
    """``chunks`` chunks of ``chunk_size`` bytes, allocated up front and reused.

    :meth:`acquire` waits (FIFO) while every chunk is taken; :meth:`release`
    hands a chunk to the first waiter, or back to the free list.  Safe to use
    from several threads and loops: a waiter is woken on its own loop.
    """

    def __init__(self, chunk_size: int = DEFAULT_CHUNK, chunks: int = DEFAULT_CHUNKS,
                 allocator: Allocator = host_allocator, name: str = "staging") -> None:
        if chunk_size <= 0 or chunks <= 0:
            raise BadRequest("a staging pool needs a positive chunk size and count")
        self.name = name
        self.chunk_size = chunk_size
        self.capacity = chunks
        self._chunks: list[StagingChunk] = []
        for i in range(chunks):
            view, ptr, keep = allocator(chunk_size)
            self._chunks.append(StagingChunk(i, view[:chunk_size], ptr, keep))
        self._free: collections.deque[StagingChunk] = collections.deque(self._chunks)
        self._waiters: collections.deque[
            tuple[asyncio.AbstractEventLoop, asyncio.Future[StagingChunk]]] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False
        # Figures for tests and metrics.
        self.acquired = 0
        self.waited = 0
        self.max_in_use = 0

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def free(self) -> int:
        return len(self._free)

    def try_acquire(self) -> StagingChunk | None:
        with self._lock:
            if self._free and not self._waiters:
                return self._take()
        return None

    def _take(self) -> StagingChunk:
        chunk = self._free.popleft()
        self.acquired += 1
        self.max_in_use = max(self.max_in_use, self.capacity - len(self._free))
        return chunk

    async def acquire(self) -> StagingChunk:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise BadRequest(f"{self.name} is closed")
            if self._free and not self._waiters:
                return self._take()
            fut: asyncio.Future[StagingChunk] = loop.create_future()
            self._waiters.append((loop, fut))
            self.waited += 1
        try:
            return await fut
        except asyncio.CancelledError:
            # A chunk handed over just as we were cancelled goes back.
            if fut.done() and not fut.cancelled():
                self.release(fut.result())
            raise

    def release(self, chunk: StagingChunk) -> None:
        with self._lock:
            while self._waiters:
                loop, fut = self._waiters.popleft()
                if fut.done():
                    continue
                self.acquired += 1
                self._hand(loop, fut, chunk)
                return
            self._free.append(chunk)

    def _hand(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[StagingChunk],
              chunk: StagingChunk | None) -> None:
        def settle() -> None:
            if fut.done():
                # Cancelled after it was chosen: the chunk is not lost, it goes on.
                if chunk is not None:
                    self.release(chunk)
                return
            if chunk is None:
                fut.set_exception(BadRequest(f"{self.name} is closed"))
            else:
                fut.set_result(chunk)

        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.call_soon(settle)  # never under our lock, never re-entrant
        else:
            loop.call_soon_threadsafe(settle)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            waiters, self._waiters = self._waiters, collections.deque()
        for loop, fut in waiters:
            self._hand(loop, fut, None)


class DeviceIO:
    """The staging path of device memory: its group's stream, event waiter and staging.

    A Memory without a host view gives one of these as ``staging`` (and the
    device address of a range by ``device_address``); the pipeline functions
    below move its bytes.  ``worker`` (a GPU group's pinned thread, None for
    the stand-in) is where host-side copies into and out of staging run, off
    the daemon's loop.
    """

    def __init__(self, stream: DeviceStream, waiter: EventWaiter, pool: StagingPool,
                 worker: Any = None) -> None:
        self.stream = stream
        self.waiter = waiter
        self.pool = pool
        self.worker = worker


# -- the pipeline -----------------------------------------------------------------------

def _release(pool: StagingPool, chunk: StagingChunk, _done: object) -> None:
    pool.release(chunk)


SendChunk = Callable[[memoryview], Awaitable[None]]


async def device_to_wire(stream: DeviceStream, waiter: EventWaiter, pool: StagingPool,
                         dev_ptr: int, size: int, send: SendChunk, depth: int = 2) -> int:
    """Copy ``size`` device bytes out through staging, chunk by chunk, to ``send``.

    ``send(view)`` must resolve once ``view`` may be reused (the bytes left
    it).  Up to ``depth`` chunks are in flight: the D2H copy of chunk k+1 is
    on the stream while chunk k is sent.  Returns the number of chunks.
    """
    step = pool.chunk_size
    pending: collections.deque[tuple[Any, asyncio.Future[None], int]] = collections.deque()
    pos = 0
    n = 0
    try:
        while pos < size or pending:
            while pos < size and len(pending) < max(1, depth):
                # Wait for staging only while holding none: a GET that holds
                # chunks sends them first, so GETs sharing a pool never
                # deadlock each other, and a pool of one still works.
                got = pool.try_acquire() if pending else await pool.acquire()
                if got is None:
                    break
                chunk = got
                k = min(step, size - pos)
                stream.copy_d2h(chunk.ptr, dev_ptr + pos, k)
                pending.append((chunk, waiter.wait(stream.record()), k))
                pos += k
            chunk, done, k = pending.popleft()
            try:
                await done
                await send(chunk.view[:k])
            finally:
                pool.release(chunk)
            n += 1
    finally:
        for chunk, done, _ in pending:
            # A failed send: the copies still in flight own their chunks until done.
            done.add_done_callback(functools.partial(_release, pool, chunk))
    return n


async def wire_to_device(stream: DeviceStream, waiter: EventWaiter, pool: StagingPool,
                         dev_ptr: int, size: int,
                         receive: Callable[[memoryview], Awaitable[None]]) -> int:
    """Fill staging chunk by chunk with ``receive(view)``, then H2D each chunk.

    The H2D copy of chunk k runs while chunk k+1 is received; resolves once
    the last copy completed (every byte is on the device).
    """
    step = pool.chunk_size
    pos = 0
    n = 0
    inflight: list[asyncio.Future[None]] = []
    while pos < size:
        chunk = await pool.acquire()
        k = min(step, size - pos)
        try:
            await receive(chunk.view[:k])
        except BaseException:
            pool.release(chunk)
            raise
        stream.copy_h2d(dev_ptr + pos, chunk.ptr, k)
        done = waiter.wait(stream.record())
        done.add_done_callback(functools.partial(_release, pool, chunk))
        inflight.append(done)
        inflight = [f for f in inflight if not f.done()]
        pos += k
        n += 1
    if inflight:
        await asyncio.gather(*inflight)
    return n


class GatedLanding:
    """Bytes that reached staging go to the device; ``then`` runs once they are there.

    For the engine on device regions: a peer's WRITE is received into a
    staging chunk, :meth:`land` enqueues its H2D copy and records an event,
    and only when that event completed does ``then`` run (count the
    immediate, acknowledge the write) and the chunk go back to the pool.
    ``then`` runs on the event waiter's thread; the ImmCounter is thread safe.
    """

    def __init__(self, stream: DeviceStream, waiter: EventWaiter, pool: StagingPool) -> None:
        self.stream = stream
        self.waiter = waiter
        self.pool = pool
        self._lock = threading.Lock()
        self.landing = 0  # copies enqueued whose event has not completed

    def land(self, chunk: StagingChunk, pieces: list[tuple[int, int, int]],
             then: Callable[[], None]) -> None:
        """``pieces``: (device address, offset in the chunk, length), bounds checked."""
        for _dev, off, n in pieces:
            if off < 0 or n < 0 or off + n > chunk.size:
                raise BadRequest(f"[{off}, +{n}) is outside a staging chunk of {chunk.size}")
        for dev_ptr, off, n in pieces:
            self.stream.copy_h2d(dev_ptr, chunk.ptr + off, n)
        with self._lock:
            self.landing += 1
        event = self.stream.record()

        def completed() -> None:
            with self._lock:
                self.landing -= 1
            try:
                then()
            finally:
                self.pool.release(chunk)

        self.waiter.watch(event, completed)
