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
``stream``: a ``cupy.cuda.Stream`` (default: the calling thread's current
stream, of its current device; client/devices.py), or any
:class:`transferd.memory.streams.DeviceStream` (the tests' host stand-in).
Events are recorded with the stream's own device current.

Completions are learned by event-waiter threads: at most
:data:`MAX_WAITERS` per client whatever the number of streams used (a stream
shares the least busy one once there are that many).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transferd.protocol.errors import BadRequest, TransferdError
from transferd.protocol.messages import Tensor, as_tensor

from .devices import capture_stream, device_range
from .queue import QueuedSet

if TYPE_CHECKING:
    from transferd.memory.staging import StagingChunk, StagingPool
    from transferd.memory.streams import DeviceStream, EventWaiter

    from .calls import Queue

COPY_CHUNK = 4 << 20
COPY_CHUNKS = 8
# Event-waiter threads per client at most, and streams remembered.
MAX_WAITERS = 4
MAX_STREAMS = 64


def _matched(t: Tensor | tuple[int, int, int], device: Any) -> tuple[Tensor, int]:
    """A copy's remote tensor and the pointer of its device side, which must hold as
    many bytes as the tensor."""
    t = as_tensor(t)
    ptr, nbytes = device_range(device)
    if nbytes != t.size:
        raise BadRequest(f"{nbytes} device bytes for a tensor of {t.size}")
    return t, ptr


@dataclass(slots=True)
class QueuedCopy(QueuedSet):
    """A SET whose bytes are still being copied off a device into ``data`` (staging)."""

    ready: asyncio.Future[None] | None = None
    chunk: Any = None
    pool: Any = None


class _Waiters:
    """At most MAX_WAITERS event-waiter threads, shared by every stream a client uses."""

    def __init__(self) -> None:
        self._all: list[EventWaiter] = []
        self._of: OrderedDict[int, EventWaiter] = OrderedDict()

    def __len__(self) -> int:
        return len(self._all)

    def of(self, stream: DeviceStream) -> EventWaiter:
        key = id(stream)
        w = self._of.get(key)
        if w is not None:
            self._of.move_to_end(key)
            return w
        if len(self._all) < MAX_WAITERS:
            from transferd.memory.streams import EventWaiter

            w = EventWaiter(stream, name=f"transferd-copies-{len(self._all)}")
            self._all.append(w)
        else:
            # Its events queue behind another stream's: the least busy waiter's.
            w = min(self._all, key=lambda x: x.waiting)
        self._of[key] = w
        if len(self._of) > MAX_STREAMS:
            self._of.popitem(last=False)
        return w

    def close(self) -> None:
        for w in self._all:
            w.close()
        self._all.clear()
        self._of.clear()


class Copies:
    """``copy_from_device`` / ``copy_to_device`` of a Client, on the Client's queue.

    Holds the client's pinned staging pool (made on first use), the stream
    wrappers and the event waiters; ``queued`` counts the copies waiting in
    the client's queue (a flush looks at them only when there are some).
    """

    def __init__(self, client: Queue) -> None:
        self._client = client
        self.pool: StagingPool | None = None
        self.waiters = _Waiters()
        self.queued = 0
        self._streams: OrderedDict[tuple[int, int], DeviceStream] = OrderedDict()
        self._tasks: set[asyncio.Future[None]] = set()

    def use_staging(self, pool: StagingPool) -> None:
        """Use ``pool`` (pinned, bounded) for this client's async copies."""
        self.pool = pool

    def close(self) -> None:
        self.waiters.close()

    def _stream(self, stream: Any) -> DeviceStream:
        s = capture_stream(stream)
        inner = getattr(s, "stream", None)
        if inner is None:  # a DeviceStream of its own (the stand-in)
            return s
        # One wrapper per CUDA stream and device (every null stream's ptr is 0).
        key = (int(inner.ptr), int(getattr(s, "index", 0)))
        known = self._streams.get(key)
        if known is not None:
            self._streams.move_to_end(key)
            return known
        self._streams[key] = s
        if len(self._streams) > MAX_STREAMS:
            self._streams.popitem(last=False)
        return s

    def _staging(self, stream: DeviceStream) -> StagingPool:
        if self.pool is None:
            from transferd.memory.staging import StagingPool, host_allocator

            alloc = host_allocator
            if type(stream).__name__ == "CudaStream":
                from transferd.memory.cuda import pinned_allocator

                alloc = pinned_allocator
            self.pool = StagingPool(COPY_CHUNK, COPY_CHUNKS, alloc, name="client copy staging")
        return self.pool

    async def copy_from_device(self, t: Tensor | tuple[int, int, int], src: Any, *,
                               stream: Any = None) -> None:
        """Device -> remote tensor ``t``: enqueued on ``stream``, sent once copied."""
        t, ptr = _matched(t, src)
        s = self._stream(stream)
        client = self._client
        if not client.switches.async_copy:
            await self._from_device_sync(t, s, ptr)
            return
        pool, waiter = self._staging(s), self.waiters.of(s)
        pos = 0
        while pos < t.size:
            chunk = await pool.acquire()  # back-pressure when staging is all in flight
            n = min(chunk.size, t.size - pos)
            s.copy_d2h(chunk.ptr, ptr + pos, n)
            ready = waiter.wait(s.record())
            op = QueuedCopy(Tensor(t.buffer, t.offset + pos, n), chunk.view[:n], ready, chunk,
                            pool)
            client._op_queue().append(op)
            self.queued += 1
            ready.add_done_callback(self._ready)
            pos += n
        if t.size == 0:
            client._op_queue().append(QueuedSet(t, b""))

    async def _from_device_sync(self, t: Tensor, s: DeviceStream, ptr: int) -> None:
        # The fallback the seed replaced: synchronize the producer, copy to
        # host memory, a synchronous SET.
        import numpy as np

        host = bytearray(t.size)
        s.synchronize_device()  # what ggml_backend_synchronize(CUDA0) did
        if t.size:
            s.copy_d2h(int(np.frombuffer(host, dtype=np.uint8).ctypes.data), ptr, t.size)
        s.synchronize()
        await self._client.set_tensor(t, host)

    def _ready(self, fut: asyncio.Future[None]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self._drop(fut)
        task = asyncio.ensure_future(self._dispatch())
        self._tasks.add(task)  # kept until done (the loop holds tasks only weakly)
        task.add_done_callback(self._tasks.discard)

    async def _dispatch(self) -> None:
        """Send the queue's prefix up to the last copy whose bytes are in staging."""
        client = self._client
        q = client._queue
        k = 0
        last = 0
        for i, op in enumerate(q):
            if type(op) is QueuedCopy:
                if op.ready is None or not op.ready.done():
                    break
                last = i + 1
            k = i + 1
        k = min(k, last) if last else 0
        if not k:
            return
        try:
            conn = client.conn
        except Exception:
            return
        if conn.lost is not None:
            return
        ops, client._queue = q[:k], q[k:]
        self.queued = sum(1 for op in client._queue if type(op) is QueuedCopy)
        try:
            client._send_now(ops)
            await self.written()
        finally:
            _release(ops)

    def _drop(self, fut: asyncio.Future[None]) -> None:
        """A copy the device failed: its SET never goes (its staging holds nothing of
        it); the fault is raised at the next flush point, as a one-way failure is."""
        client = self._client
        for i, op in enumerate(client._queue):
            if type(op) is QueuedCopy and op.ready is fut:
                del client._queue[i]
                self.queued -= 1
                _release([op])
                break
        exc = fut.exception()
        if isinstance(exc, TransferdError):
            with contextlib.suppress(TransferdError):
                client.conn.note_failure(exc)

    async def take_queue(self) -> list[Any]:
        """At a flush point: once every queued copy's bytes are in staging, the queue
        (less the copies the device failed: the flush raises their faults)."""
        client = self._client
        pending = [op.ready for op in client._queue
                   if type(op) is QueuedCopy and op.ready is not None and not op.ready.done()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        ops, client._queue = client._queue, []
        self.queued = 0
        return ops

    async def copy_to_device(self, dst: Any, t: Tensor | tuple[int, int, int], *,
                             stream: Any = None) -> None:
        """Remote tensor ``t`` -> device: read into staging, async H2D on ``stream``."""
        t, ptr = _matched(t, dst)
        s = self._stream(stream)
        client = self._client
        if not client.switches.async_copy:
            import numpy as np

            host = await client.get_tensor(t)
            if t.size:
                s.copy_h2d(ptr, int(np.frombuffer(host, dtype=np.uint8).ctypes.data), t.size)
            s.synchronize()
            return
        pool, waiter = self._staging(s), self.waiters.of(s)
        pos = 0
        while pos < t.size:
            chunk = await pool.acquire()
            n = min(chunk.size, t.size - pos)
            try:
                await client.get_tensor(Tensor(t.buffer, t.offset + pos, n), out=chunk.view[:n])
            except BaseException:
                pool.release(chunk)
                raise
            s.copy_h2d(ptr + pos, chunk.ptr, n)
            waiter.watch(s.record(), functools.partial(_back, pool, chunk))
            pos += n

    async def written(self) -> None:
        """Until the transport's write buffer is empty: the staging views in it were sent."""
        try:
            t = self._client.conn.transport
        except Exception:
            return
        delay = 0.0
        while t is not None and not t.is_closing() and t.get_write_buffer_size():
            await asyncio.sleep(delay)
            delay = min(0.002, delay * 2 or 0.00005)

    async def release_sent(self, ops: list[Any]) -> None:
        """After a flush sent ``ops``: their staging goes back once written out."""
        try:
            await self.written()
        finally:
            _release(ops)


def _back(pool: StagingPool, chunk: StagingChunk, _outcome: object) -> None:
    pool.release(chunk)


def _release(ops: list[Any]) -> None:
    for op in ops:
        if type(op) is QueuedCopy and op.chunk is not None:
            chunk: StagingChunk = op.chunk
            op.chunk = None
            op.pool.release(chunk)
