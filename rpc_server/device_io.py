"""Tensors on device buffers: SET, GET, COPY and CLEAR through the staging pipeline.

A device buffer (``cuda:N``) has no host view; its Memory gives its staging
path (``staging``: its group's stream, event waiter and pinned staging, a
``DeviceIO``) and ``device_address(offset, size)``, bounds checked.
The core handlers (handlers.py) call in here when a tensor lies in such a
buffer; host tensors never come here, so the host path is unchanged.

- SET: the payload lands straight in staging chunks when enough are free now
  (the sink cannot wait), else it is collected and pushed through staging
  with back-pressure; either way async H2D copies follow and the command
  finishes (the next frame of the connection runs) once their events
  completed.  A later GET on the connection therefore sees the bytes.
- GET: the reply header goes out first, then each tensor: host views as
  they lie, device ranges by the pipeline (the D2H of chunk k+1 overlaps the
  send of chunk k); the staging chunk goes back once the transport drained.
- COPY: device to device on the device (one D2D copy, any GPU pair under
  unified addressing); host to device and back by one async copy.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from transferd.copies import COUNTING, count
from transferd.memory.base import Ref
from transferd.memory.staging import DeviceIO, StagingChunk, device_to_wire
from transferd.protocol.constants import HEADER_SIZE
from transferd.protocol.errors import BadRequest, ConnectionLost
from transferd.protocol.frames import Frame, Sink
from transferd.protocol.messages import Tensor

if TYPE_CHECKING:
    from transferd.memory import Buffer

    from .session import Session

Pair = tuple["Buffer", Tensor]


def io_of(buf: Buffer) -> DeviceIO | None:
    return buf.staging


def any_device(pairs: Sequence[Pair]) -> bool:
    return any(io_of(b) is not None for b, _ in pairs)


def _dev_ptr(buf: Buffer, t: Tensor) -> int:
    return buf.device_address(t.offset, t.size)


def _host_ptr(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


# -- SET ----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Landing:
    """A SET frame's device pieces, staged by its sink, waiting for its handler."""

    pieces: list[tuple[DeviceIO, int, StagingChunk, int, int]] = field(default_factory=list)
    chunks: list[tuple[DeviceIO, StagingChunk]] = field(default_factory=list)
    refs: list[Ref] = field(default_factory=list)
    collected: list[tuple[Pair, int]] = field(default_factory=list)  # (pair, payload offset)
    done: bool = False

    def release(self) -> None:
        if not self.done:
            self.done = True
            for io, chunk in self.chunks:
                io.pool.release(chunk)
            for r in self.refs:
                r.release()

    def __del__(self) -> None:
        # A frame whose connection died mid-payload never reaches its handler.
        self.release()


LANDINGS: weakref.WeakKeyDictionary[Session, dict[int, _Landing]] = weakref.WeakKeyDictionary()


def set_sink(session: Session, frame: Frame, pairs: Sequence[Pair]) -> Sink:
    """Where a SET's payload goes when a tensor of it lies in device memory."""
    total = sum(t.size for _, t in pairs)
    if total != frame.payload_len:
        raise BadRequest(f"tensors hold {total} bytes but the payload has {frame.payload_len}")
    landing = _Landing(refs=[b.ref() for b in {id(b): b for b, _ in pairs}.values()])
    views: list[memoryview] = []
    try:
        staged = _stage(landing, pairs, views)
    except BaseException:
        landing.release()
        raise
    table = LANDINGS.setdefault(session, {})
    old = table.pop(frame.seq, None)
    if old is not None:
        old.release()
    table[frame.seq] = landing
    if staged:
        return views
    # Not enough staging free now: the payload is collected (its size is the
    # tensors' own, already checked against our buffers) and staged later.
    pos = 0
    for pair in pairs:
        landing.collected.append((pair, pos))
        pos += pair[1].size
    return None


def _stage(landing: _Landing, pairs: Sequence[Pair], views: list[memoryview]) -> bool:
    """Views for the payload, device parts in free staging chunks; False if too few."""
    chunk: StagingChunk | None = None
    used = 0
    for buf, t in pairs:
        io = io_of(buf)
        if io is None:
            views.append(buf.view(t.offset, t.size))
            continue
        dev = _dev_ptr(buf, t)
        left, pos = t.size, 0
        while left:
            if chunk is None or used == chunk.size or landing.chunks[-1][0] is not io:
                chunk = io.pool.try_acquire()
                if chunk is None:
                    for cio, c in landing.chunks:
                        cio.pool.release(c)
                    landing.chunks.clear()
                    landing.pieces.clear()
                    views.clear()
                    return False
                landing.chunks.append((io, chunk))
                used = 0
            n = min(left, chunk.size - used)
            views.append(chunk.view[used : used + n])
            landing.pieces.append((io, dev + pos, chunk, used, n))
            used += n
            pos += n
            left -= n
    return True


def finish_set(session: Session, frame: Frame) -> Awaitable[None] | None:
    """The SET's handler half: copy staged bytes to their devices, finish when there."""
    table = LANDINGS.get(session)
    landing = table.pop(frame.seq, None) if table else None
    if landing is None:
        return None
    return _land(landing, frame.payload)


async def _land(landing: _Landing, payload: bytearray | None) -> None:
    try:
        waits: list[Awaitable[None]] = []
        for io, dev, chunk, off, n in landing.pieces:
            io.stream.copy_h2d(dev, chunk.ptr + off, n)
        by_io = {id(io): io for io, *_ in landing.pieces}
        for dio in by_io.values():
            waits.append(dio.waiter.wait(dio.stream.record()))
        if landing.collected and payload is not None:
            src = memoryview(payload)
            for (buf, t), pos in landing.collected:
                bio = io_of(buf)
                if bio is None:
                    buf.view(t.offset, t.size)[:] = src[pos : pos + t.size]
                    if COUNTING:
                        count("device_io.collected", t.size)
                    continue
                waits.append(_push(bio, _dev_ptr(buf, t), src[pos : pos + t.size]))
        if waits:
            await asyncio.gather(*waits)
    finally:
        landing.release()


def _back(io: DeviceIO, chunk: StagingChunk, _done: object) -> None:
    io.pool.release(chunk)


async def _push(io: DeviceIO, dev: int, data: memoryview) -> None:
    """Bytes in host memory to the device, chunk by chunk through staging (it may wait)."""
    pos, waits = 0, []
    while pos < len(data):
        chunk = await io.pool.acquire()
        n = min(chunk.size, len(data) - pos)
        chunk.view[:n] = data[pos : pos + n]
        io.stream.copy_h2d(dev + pos, chunk.ptr, n)
        done = io.waiter.wait(io.stream.record())
        done.add_done_callback(functools.partial(_back, io, chunk))
        waits.append(done)
        pos += n
    if waits:
        await asyncio.gather(*waits)


# -- GET ----------------------------------------------------------------------------------


async def _drained(session: Session) -> None:
    """Until the transport's write buffer is empty (the views in it may be reused)."""
    t = session.transport
    delay = 0.0
    while t is not None and t.get_write_buffer_size():
        if t.is_closing():
            raise ConnectionLost("the client went away during a GET")
        await asyncio.sleep(delay)
        delay = min(0.002, delay * 2 or 0.00005)
    if t is None or t.is_closing():
        raise ConnectionLost("the client went away during a GET")


def get_reply(session: Session, frame: Frame, pairs: Sequence[Pair]) -> Awaitable[Any]:
    """A GET_TENSOR(S) reply streamed from device memory (and host, in order)."""
    from .handlers import Reply

    refs = [b.ref() for b in {id(b): b for b, _ in pairs}.values()]
    total = sum(t.size for _, t in pairs)

    # Every range is checked before the first byte goes out.
    ptrs = [None if io_of(b) is None else _dev_ptr(b, t) for b, t in pairs]
    for (b, t), p in zip(pairs, ptrs, strict=True):
        if p is None:
            b.view(t.offset, t.size)

    async def stream() -> Reply:
        transport = session.transport
        try:
            if transport is None or transport.is_closing():
                raise ConnectionLost("the client went away before the GET")
            head = session.stream_head(frame, total)
            transport.write(head)

            async def send(view: memoryview) -> None:
                transport.write(view)
                await _drained(session)

            for (buf, t), ptr in zip(pairs, ptrs, strict=True):
                io = io_of(buf)
                if io is None or ptr is None:
                    await send(buf.view(t.offset, t.size))
                else:
                    await device_to_wire(io.stream, io.waiter, io.pool, ptr, t.size, send)
            session.ctx.stats.bytes_out += HEADER_SIZE + total
        except ConnectionLost:
            pass  # nobody to answer
        except Exception:
            # Part of the reply may be out: an error frame now would be read as
            # payload, so the connection is closed instead.
            if transport is not None:
                transport.close()
            raise
        finally:
            for r in refs:
                r.release()
        return Reply(sent=True)

    return stream()


# -- COPY and CLEAR -----------------------------------------------------------------------


def copy(src: Pair, dst: Pair) -> Awaitable[None]:
    (sb, st), (db, dt) = src, dst
    if st.size != dt.size:
        raise BadRequest(f"copy of {st.size} bytes into a tensor of {dt.size}")
    sio, dio = io_of(sb), io_of(db)
    io = dio or sio
    assert io is not None
    s = _dev_ptr(sb, st) if sio is not None else _host_ptr(sb.view(st.offset, st.size))
    d = _dev_ptr(db, dt) if dio is not None else _host_ptr(db.view(dt.offset, dt.size))
    refs = [sb.ref(), db.ref()]
    # One stream orders it (the destination's); cudaMemcpyDefault finds the direction.
    io.stream.copy_d2d(d, s, st.size)
    done = io.waiter.wait(io.stream.record())

    async def wait() -> None:
        try:
            await done
        finally:
            for r in refs:
                r.release()

    return wait()


def clear(buf: Buffer, value: int) -> Awaitable[None]:
    if not 0 <= value <= 255:
        raise BadRequest(f"clear value {value} is not a byte (0-255)")
    io = io_of(buf)
    assert io is not None
    ref = buf.ref()
    io.stream.fill(_dev_ptr(buf, Tensor(buf.id, 0, buf.size)), value, buf.size)
    done = io.waiter.wait(io.stream.record())

    async def wait() -> None:
        try:
            await done
        finally:
            ref.release()

    return wait()


# -- client-owned GPU memory ----------------------------------------------------------------


def register_ipc(session: Session, frame: Frame, device: str, size: int) -> Any:
    """ALLOC_BUFFER with ``ipc_handle``: open a client's CUDA allocation as a buffer.

    Owned by the connection: closed (``cudaIpcCloseMemHandle``) when it goes,
    or at FREE_BUFFER.  Tensors on it are served like any device buffer's.
    """
    from transferd.protocol.messages import bytes_field, uint_field

    from .handlers import Reply

    source = session.ctx.buffers.pool(device).spec.source
    if source is None or not device.startswith("cuda:"):
        raise BadRequest(f"CUDA IPC memory is registered on a cuda:N device, not {device!r}")
    handle = bytes_field(frame.body, "ipc_handle")
    offset = uint_field(frame.body, "ipc_offset") if "ipc_offset" in frame.body else 0
    buf = session.ctx.buffers.alloc(
        device, size, owner=session, create=lambda: source.open_ipc(handle, offset, size))
    return Reply({"buffer": buf.id, "size": buf.size, "ipc": True})
