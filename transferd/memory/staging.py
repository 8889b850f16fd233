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
- :func:`host_to_device` / :func:`device_to_host` (a COPY against host
  memory): the same pipelines with a host-side copy into or out of staging,
  on the device's worker; the loop never waits on a copy from pageable memory.
- :class:`GatedLanding` (the engine): an immediate is counted only after the
  device copy that lands its bytes completed (its event), never when the
  bytes reached staging, and never if the device failed it.

Staging goes back to its pool only once the device is done with it: every
path releases its chunks through :class:`Claim` / :func:`release_after`,
after the event that follows its last copy on them, whatever ended the
operation (a cancel, a deadline, a client gone mid-GET).

They talk to a :class:`~transferd.memory.streams.DeviceStream` only, so they
are tested on any machine with the host stand-in of ``tests/``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import mmap
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transferd.copies import COUNTING, count
from transferd.protocol.errors import BadRequest

from .streams import DeviceEvent, DeviceFault, DeviceStream, EventWaiter, Outcome, settle

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
    def chunks(self) -> list[StagingChunk]:
        """Every chunk, taken or not (what a NIC registers once: docs/rdma.md)."""
        return list(self._chunks)

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


# -- holding staging while the device may still touch it ---------------------------------


def release_after(io: DeviceIO, chunks: list[StagingChunk], event: DeviceEvent | None) -> None:
    """Give ``chunks`` back to ``io``'s pool once ``event`` ended (at once if it has).

    ``event`` is the last one recorded after every copy enqueued on these
    chunks: until it completed the device may still read or write them, so
    nobody else may have them.  Whatever ended the operation (done, failed,
    cancelled, timed out, the client gone), this is how its staging goes back.
    """
    if not chunks:
        return
    pool = io.pool
    if event is None or event.outcome() is not False:
        for c in chunks:
            pool.release(c)
        return

    def back(_outcome: Outcome) -> None:
        # A failed copy is over too: the device no longer touches the chunk.
        for c in chunks:
            pool.release(c)

    io.waiter.watch(event, back)


class Claim:
    """Staging chunks one operation holds, and the event after its last copy on them.

    :meth:`fence` records an event after the copies enqueued so far and
    remembers it; :meth:`release` (idempotent; call it in a ``finally``)
    gives the chunks back once that event ended (one it records then if none
    was), never while a copy on them may still run.  Chunks taken by
    :meth:`take` are the claim's as soon as they are acquired, so a cancelled
    take loses none.
    """

    def __init__(self, io: DeviceIO) -> None:
        self.io = io
        self.chunks: list[StagingChunk] = []
        self._fence: DeviceEvent | None = None
        self._released = False

    async def take(self, n: int) -> list[StagingChunk]:
        for _ in range(n):
            self.chunks.append(await self.io.pool.acquire())
        return self.chunks

    def try_take(self) -> StagingChunk | None:
        chunk = self.io.pool.try_acquire()
        if chunk is not None:
            self.chunks.append(chunk)
        return chunk

    def fence(self) -> DeviceEvent:
        """An event after every copy enqueued so far; the chunks stay until it ended."""
        self._fence = event = self.io.stream.record()
        return event

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        chunks, self.chunks = self.chunks, []
        fence = self._fence
        if fence is None and chunks:
            # Ended before its fence (a copy that raised, a cancel between two
            # enqueues): copies may be on the stream already; an event now covers them.
            try:
                fence = self.io.stream.record()
            except DeviceFault:
                fence = None  # a dead device runs nothing more: they are free
        release_after(self.io, chunks, fence)

    def settle(self) -> asyncio.Future[None]:
        """Fence the copies enqueued so far and let the chunks go once it ended.

        A future of the running loop that resolves (or fails with the
        DeviceFault) once the chunks are back in the pool: whoever awaits it
        finds the staging free again.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        event = self.fence()
        self._released = True
        chunks, self.chunks = self.chunks, []
        pool = self.io.pool

        def back(outcome: Outcome) -> None:
            for c in chunks:
                pool.release(c)
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(settle, fut, outcome)

        ended = event.outcome()
        if ended is False:
            self.io.waiter.watch(event, back)
        else:
            back(ended)
        return fut


# -- the pipeline -----------------------------------------------------------------------


SendChunk = Callable[[memoryview], Awaitable[None]]


async def device_to_wire(io: DeviceIO, dev_ptr: int, size: int, send: SendChunk,
                         depth: int = 2) -> int:
    """Copy ``size`` device bytes out through staging, chunk by chunk, to ``send``.

    ``send(view)`` must resolve once ``view`` may be reused (the bytes left
    it).  Up to ``depth`` chunks are in flight: the D2H copy of chunk k+1 is
    on the stream while chunk k is sent.  Returns the number of chunks.  A
    failed copy raises its DeviceFault before its chunk is sent; a chunk goes
    back to the pool only once its copy ended, however this ends.
    """
    stream, waiter, pool = io.stream, io.waiter, io.pool
    step = pool.chunk_size
    pending: collections.deque[
        tuple[StagingChunk, DeviceEvent, asyncio.Future[None], int]] = collections.deque()
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
                try:
                    stream.copy_d2h(chunk.ptr, dev_ptr + pos, k)
                    event = stream.record()
                except BaseException:
                    pool.release(chunk)  # nothing was enqueued on it
                    raise
                pending.append((chunk, event, waiter.wait(event), k))
                pos += k
            chunk, event, done, k = pending[0]
            await done
            await send(chunk.view[:k])
            pending.popleft()
            pool.release(chunk)  # its copy completed and its bytes were sent
            n += 1
    finally:
        for chunk, event, done, _ in pending:
            if done.done():
                if not done.cancelled():
                    done.exception()  # seen: its fault (if any) went up already
            else:
                done.cancel()  # nobody awaits it now
            release_after(io, [chunk], event)
    return n


async def wire_to_device(io: DeviceIO, dev_ptr: int, size: int,
                         receive: Callable[[memoryview], Awaitable[None]]) -> int:
    """Fill staging chunk by chunk with ``receive(view)``, then H2D each chunk.

    The H2D copy of chunk k runs while chunk k+1 is received; resolves once
    the last copy completed (every byte is on the device), or raises the
    DeviceFault of one that failed.
    """
    step = io.pool.chunk_size
    pos = 0
    n = 0
    inflight: list[asyncio.Future[None]] = []
    while pos < size:
        claim = Claim(io)
        try:
            chunk = (await claim.take(1))[0]
            k = min(step, size - pos)
            await receive(chunk.view[:k])
            io.stream.copy_h2d(dev_ptr + pos, chunk.ptr, k)
            inflight.append(claim.settle())
        finally:
            claim.release()  # back once its copy ended
        inflight = [f for f in inflight if not f.done() or f.exception() is not None]
        pos += k
        n += 1
    if inflight:
        await asyncio.gather(*inflight)
    return n


async def host_to_device(io: DeviceIO, dev_ptr: int, data: memoryview) -> None:
    """Bytes in (pageable) host memory to the device, through staging chunk by chunk.

    The host-side copy into each pinned chunk runs on the device's worker
    (off the daemon's loop) where there is one; the H2D copies are async on
    the device's stream.  Resolves once every byte is on the device (or
    raises the DeviceFault of a copy that failed); staging goes back as each
    copy ends, however this ends.
    """
    pos, waits = 0, []
    while pos < len(data):
        claim = Claim(io)
        try:
            chunk = (await claim.take(1))[0]
            n = min(chunk.size, len(data) - pos)
            await host_copy(io, chunk.view[:n], data[pos : pos + n])
            io.stream.copy_h2d(dev_ptr + pos, chunk.ptr, n)
            waits.append(claim.settle())
        finally:
            claim.release()
        pos += n
    if waits:
        await asyncio.gather(*waits)


async def device_to_host(io: DeviceIO, out: memoryview, dev_ptr: int, depth: int = 2) -> None:
    """Device bytes into (pageable) host memory ``out``, through staging.

    The D2H copy of chunk k+1 is on the stream while chunk k is copied out
    of staging (on the device's worker where there is one).
    """
    pos = 0

    async def into_host(view: memoryview) -> None:
        nonlocal pos
        await host_copy(io, out[pos : pos + len(view)], view)
        pos += len(view)

    await device_to_wire(io, dev_ptr, len(out), into_host, depth)


async def host_copy(io: DeviceIO, dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` between host memory and staging, on the device's worker if any."""
    worker = io.worker
    if worker is None or len(dst) < HOST_COPY_OFF_LOOP:
        dst[:] = src
    else:
        # numpy copies without the GIL: the loop serves others meanwhile.
        def run() -> None:
            np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))

        await asyncio.wrap_future(worker.run(_call(run)))
    if COUNTING:
        count("staging.host_copy", len(dst))


# A host-side copy of less than this is done on the loop (the hand-off costs more).
HOST_COPY_OFF_LOOP = 256 * 1024


async def _call(fn: Callable[[], None]) -> None:
    fn()


class GatedLanding:
    """Bytes that reached staging go to the device; ``then`` runs once they are there.

    For the engine on device regions: a peer's WRITE is received into a
    staging chunk, :meth:`land` enqueues its H2D copy and records an event,
    and only when that event ended does ``then(outcome)`` run: None, the bytes
    are in place (count the immediate, acknowledge the write); a DeviceFault,
    they are not (count nothing, fail the write).  The chunk goes back to the
    pool then either way.  ``then`` runs on the event waiter's thread; the
    ImmCounter is thread safe.
    """

    def __init__(self, io: DeviceIO) -> None:
        self.io = io
        self._lock = threading.Lock()
        self.landing = 0  # copies enqueued whose event has not completed

    def land(self, chunk: StagingChunk, pieces: list[tuple[int, int, int]],
             then: Callable[[Outcome], None]) -> None:
        """``pieces``: (device address, offset in the chunk, length), bounds checked."""
        for _dev, off, n in pieces:
            if off < 0 or n < 0 or off + n > chunk.size:
                raise BadRequest(f"[{off}, +{n}) is outside a staging chunk of {chunk.size}")
        stream = self.io.stream
        for dev_ptr, off, n in pieces:
            stream.copy_h2d(dev_ptr, chunk.ptr + off, n)
        with self._lock:
            self.landing += 1
        event = stream.record()

        def completed(outcome: Outcome) -> None:
            with self._lock:
                self.landing -= 1
            try:
                then(outcome)
            finally:
                self.io.pool.release(chunk)

        self.io.waiter.watch(event, completed)
