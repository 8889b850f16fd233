"""The seed's asynchronous split copies, in the client: device <-> remote tensor.

``await c.copy_from_device(t, src, stream=s)`` (device -> remote): an async
D2H copy of ``src`` into pinned staging on the producer's stream ``s``, an
event recorded after it, and a SET of ``t`` queued in the client's queue at
this point of the order.  The call returns as soon as that is enqueued: the
producing device is never synchronized, and the host goes on (serialises the
next graph) while the copy runs.  A dispatcher sends the SET once its event
has completed; a flush point first waits for the copies queued before it.

``await c.copy_to_device(dst, t, stream=s)`` (remote -> device): the tensor is
read into pinned staging (a flush point, one round trip), then an async H2D
copy on the consumer's stream ``s`` is enqueued and the call returns; the
staging goes back once that copy's event completed.  The consumer is not
synchronized either.

The queue's rules hold: a queued copy's SET never overtakes a later flush
point, and a read queued after it waits for it (a read sees every write
issued before it).  ``TRANSFERD_NO_ASYNC_COPY=1`` (read at connect) turns
both into the synchronous fallback for A/B runs: synchronize the stream,
copy through host memory, a synchronous SET / GET.

``src`` / ``dst``: a contiguous CuPy array, or ``(device pointer, nbytes)``.
``stream``: a ``cupy.cuda.Stream`` (default: the current stream), or any
:class:`transferd.memory.streams.DeviceStream` (the tests' host stand-in).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transferd.protocol.errors import BadRequest
from transferd.protocol.messages import Tensor

from .queue import QueuedGet, QueuedSet, segments

if TYPE_CHECKING:
    from transferd.memory.staging import StagingChunk, StagingPool
    from transferd.memory.streams import DeviceStream, EventWaiter

    from .client import Client

_TASKS: set[asyncio.Future[None]] = set()
COPY_CHUNK = 4 << 20
COPY_CHUNKS = 8


@dataclass(slots=True)
class QueuedCopy(QueuedSet):
    """A SET whose bytes are still being copied off a device into ``data`` (staging)."""

    ready: asyncio.Future[None] | None = None
    chunk: Any = None
    pool: Any = None


def _device_range(obj: Any) -> tuple[int, int]:
    if isinstance(obj, tuple) and len(obj) == 2:
        return int(obj[0]), int(obj[1])
    data = getattr(obj, "data", None)
    if data is not None and hasattr(data, "ptr") and hasattr(obj, "nbytes"):
        flags = getattr(obj, "flags", None)
        if flags is not None and not flags.c_contiguous:
            raise BadRequest("a device array for an async copy must be C-contiguous")
        return int(data.ptr), int(obj.nbytes)
    raise BadRequest("expected a CuPy array or (device pointer, nbytes)")


class _Copier:
    """Per client: the pinned staging pool, and one event waiter per stream."""

    def __init__(self, pool: StagingPool | None = None) -> None:
        self.pool = pool
        self.waiters: dict[int, EventWaiter] = {}
        self.streams: dict[int, DeviceStream] = {}

    def stream(self, stream: Any) -> DeviceStream:
        from transferd.memory.streams import DeviceStream

        if isinstance(stream, DeviceStream):
            return stream
        import cupy

        from transferd.memory.cuda import CudaStream

        s = stream if stream is not None else cupy.cuda.get_current_stream()
        key = int(s.ptr)
        wrapped = self.streams.get(key)
        if wrapped is None:
            if len(self.streams) >= 64:
                self.streams.clear()  # bounded: a new wrapper is cheap
            wrapped = self.streams[key] = CudaStream(int(cupy.cuda.Device().id), s)
        return wrapped

    def waiter(self, stream: DeviceStream) -> EventWaiter:
        from transferd.memory.streams import EventWaiter

        w = self.waiters.get(id(stream))
        if w is None:
            w = self.waiters[id(stream)] = EventWaiter(stream, name="transferd-copies")
        return w

    def staging(self, stream: DeviceStream) -> StagingPool:
        if self.pool is None:
            from transferd.memory.staging import StagingPool, host_allocator

            alloc = host_allocator
            if type(stream).__name__ == "CudaStream":
                from transferd.memory.cuda import pinned_allocator

                alloc = pinned_allocator
            self.pool = StagingPool(COPY_CHUNK, COPY_CHUNKS, alloc, name="client copy staging")
        return self.pool

    def close(self) -> None:
        for w in self.waiters.values():
            w.close()
        self.waiters.clear()


class CopiesMixin:
    """``copy_from_device`` / ``copy_to_device`` of :class:`client.Client`."""

    # Async copies in the queue (a flush looks at the queue only when there are some).
    _n_copies = 0

    def _close_copies(self) -> None:
        c: _Copier | None = getattr(self, "_copies", None)
        if c is not None:
            c.close()

    def _copier(self: Client) -> _Copier:  # type: ignore[misc]
        c: _Copier | None = getattr(self, "_copies", None)
        if c is None:
            c = _Copier()
            self._copies = c
        return c

    def use_copy_staging(self: Client, pool: StagingPool) -> None:  # type: ignore[misc]
        """Use ``pool`` (pinned, bounded) for this client's async copies."""
        self._copier().pool = pool

    async def copy_from_device(  # type: ignore[misc]
        self: Client, t: Tensor | tuple[int, int, int], src: Any, *, stream: Any = None,
    ) -> None:
        """Device -> remote tensor ``t``: enqueued on ``stream``, sent once copied."""
        t = t if type(t) is Tensor else Tensor(*t)
        ptr, nbytes = _device_range(src)
        if nbytes != t.size:
            raise BadRequest(f"{nbytes} device bytes for a tensor of {t.size}")
        cp = self._copier()
        s = cp.stream(stream)
        if not self.switches.async_copy:
            await self._copy_from_device_sync(t, s, ptr)
            return
        pool, waiter = cp.staging(s), cp.waiter(s)
        pos = 0
        while pos < t.size:
            chunk = await pool.acquire()  # back-pressure when staging is all in flight
            n = min(chunk.size, t.size - pos)
            s.copy_d2h(chunk.ptr, ptr + pos, n)
            ready = waiter.wait(s.record())
            op = QueuedCopy(Tensor(t.buffer, t.offset + pos, n), chunk.view[:n], ready, chunk,
                            pool)
            self._queue.append(op)
            self._n_copies += 1
            ready.add_done_callback(self._copy_ready)
            pos += n
        if t.size == 0:
            self._queue.append(QueuedSet(t, b""))

    async def _copy_from_device_sync(  # type: ignore[misc]
        self: Client, t: Tensor, s: DeviceStream, ptr: int) -> None:
        # The fallback the seed replaced: synchronize the producer, copy to
        # host memory, a synchronous SET.
        import numpy as np

        host = bytearray(t.size)
        s.synchronize_device()  # what ggml_backend_synchronize(CUDA0) did
        if t.size:
            s.copy_d2h(int(np.frombuffer(host, dtype=np.uint8).ctypes.data), ptr, t.size)
        s.synchronize()
        await self.set_tensor(t, host)

    def _copy_ready(self: Client, _fut: asyncio.Future[None]) -> None:  # type: ignore[misc]
        task = asyncio.ensure_future(self._dispatch_copies())
        _TASKS.add(task)  # kept until done (the loop holds tasks only weakly)
        task.add_done_callback(_TASKS.discard)

    async def _dispatch_copies(self: Client) -> None:  # type: ignore[misc]
        """Send the queue's prefix up to the last copy whose bytes are in staging."""
        q = self._queue
        k = 0
        last = 0
        for i, op in enumerate(q):
            if type(op) is QueuedCopy:
                if op.ready is None or not op.ready.done():
                    break
                last = i + 1
            k = i + 1
        k = min(k, last) if last else 0
        if not k or self._conn is None or self._conn.lost is not None:
            return
        ops, self._queue = q[:k], q[k:]
        self._n_copies = sum(1 for op in self._queue if type(op) is QueuedCopy)
        try:
            for seg in segments(ops):
                self._send_sets(seg.sets)
                for gets, fut in self._send_gets(seg.gets):
                    fut.add_done_callback(functools.partial(_resolve, gets))
                    self._reads_in_flight.add(fut)
                    fut.add_done_callback(self._reads_in_flight.discard)
            await written(self)
        finally:
            _release(ops)

    async def _await_copies(self: Client) -> None:  # type: ignore[misc]
        """A flush point: every queued copy's bytes must be in staging first."""
        pending = [op.ready for op in self._queue
                   if type(op) is QueuedCopy and op.ready is not None and not op.ready.done()]
        if pending:
            await asyncio.gather(*pending)

    async def copy_to_device(  # type: ignore[misc]
        self: Client, dst: Any, t: Tensor | tuple[int, int, int], *, stream: Any = None,
    ) -> None:
        """Remote tensor ``t`` -> device: read into staging, async H2D on ``stream``."""
        t = t if type(t) is Tensor else Tensor(*t)
        ptr, nbytes = _device_range(dst)
        if nbytes != t.size:
            raise BadRequest(f"{nbytes} device bytes for a tensor of {t.size}")
        cp = self._copier()
        s = cp.stream(stream)
        if not self.switches.async_copy:
            import numpy as np

            host = await self.get_tensor(t)
            if t.size:
                s.copy_h2d(ptr, int(np.frombuffer(host, dtype=np.uint8).ctypes.data), t.size)
            s.synchronize()
            return
        pool, waiter = cp.staging(s), cp.waiter(s)
        pos = 0
        while pos < t.size:
            chunk = await pool.acquire()
            n = min(chunk.size, t.size - pos)
            try:
                await self.get_tensor(Tensor(t.buffer, t.offset + pos, n), out=chunk.view[:n])
            except BaseException:
                pool.release(chunk)
                raise
            s.copy_h2d(ptr + pos, chunk.ptr, n)
            waiter.watch(s.record(), functools.partial(_back, pool, chunk))
            pos += n


def _back(pool: StagingPool, chunk: StagingChunk, _outcome: object) -> None:
    pool.release(chunk)


def _resolve(gets: list[QueuedGet], fut: asyncio.Future[Any]) -> None:
    from .client import _resolve_gets

    _resolve_gets(gets, fut)


def _release(ops: list[Any]) -> None:
    for op in ops:
        if type(op) is QueuedCopy and op.chunk is not None:
            chunk: StagingChunk = op.chunk
            op.chunk = None
            op.pool.release(chunk)


async def written(client: Client) -> None:
    """Until the transport's write buffer is empty: the staging views in it were sent."""
    conn = client._conn
    t = conn.transport if conn is not None else None
    delay = 0.0
    while t is not None and not t.is_closing() and t.get_write_buffer_size():
        await asyncio.sleep(delay)
        delay = min(0.002, delay * 2 or 0.00005)


async def release_sent(client: Client, ops: list[Any]) -> None:
    """After a flush sent ``ops``: their staging goes back once written out."""
    try:
        await written(client)
    finally:
        _release(ops)
