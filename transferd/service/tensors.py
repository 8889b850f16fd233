"""Bytes of buffers moved inside the node: clear, copy, read and write a tensor.

Host memory is reached through its view; device memory (``cuda:N``) through its
staging path (the buffer's ``staging``: its group's stream, event waiter and pinned
staging) and ``device_address``, bounds checked.  Every range is checked before
anything is touched or enqueued.  Large host clears and copies go in slices
(:data:`SLICE`) between which the loop serves others; what the caller asked for is
done when the returned awaitable is (None: done already).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from transferd.copies import COUNTING, count
from transferd.memory.base import Ref
from transferd.memory.staging import device_to_host, host_to_device
from transferd.protocol.errors import BadRequest
from transferd.protocol.messages import Tensor

if TYPE_CHECKING:
    from transferd.memory import Buffer

# The most bytes one call clears or copies before the loop serves others: a few
# milliseconds of memset/memmove.  Larger clears and copies go on in slices between
# which other callers' work runs; this caller's next request waits until the whole
# operation is done.
SLICE = 8 << 20

Pair = tuple["Buffer", Tensor]


async def sliced(refs: Sequence[Ref], steps: Sequence[Callable[[], None]]) -> None:
    try:
        for step in steps:
            step()
            await asyncio.sleep(0)  # let the loop serve other callers
    finally:
        for r in refs:
            r.release()


def _check_byte(value: int) -> None:
    if not 0 <= value <= 255:
        raise BadRequest(f"clear value {value} is not a byte (0-255)")


def clear(buf: Buffer, value: int) -> Awaitable[None] | None:
    """Every byte of ``buf`` set to ``value``."""
    io = buf.staging
    if io is not None:
        _check_byte(value)
        dev = buf.device_address(0, buf.size)
        ref = buf.ref()
        io.stream.fill(dev, value, buf.size)
        done = io.waiter.wait(io.stream.record())

        async def wait() -> None:
            try:
                await done
            finally:
                ref.release()

        return wait()
    if buf.size <= SLICE:
        buf.clear(value)
        return None
    _check_byte(value)
    whole = buf.array(0, buf.size)  # checked (a freed buffer is NOT_FOUND) before any slice
    steps = [lambda o=o: whole[o : o + SLICE].fill(value) for o in range(0, buf.size, SLICE)]
    # The ref keeps the memory mapped if the buffer is freed between slices.
    return sliced([buf.ref()], steps)


def _copy_steps(s: Any, d: Any, size: int, backward: bool) -> list[Callable[[], None]]:
    """Slices of one copy, in the order that reads no byte an earlier slice wrote."""
    offs = list(range(0, size, SLICE))
    if backward:
        offs.reverse()

    def step(o: int) -> Callable[[], None]:
        def run() -> None:
            if COUNTING:
                count("copy_tensor", min(SLICE, size - o))
            np.copyto(d[o : o + SLICE], s[o : o + SLICE])

        return run

    return [step(o) for o in offs]


def copy(src: Pair, dst: Pair) -> Awaitable[None] | None:
    """``src``'s bytes into ``dst`` (the same size), host or device on either side."""
    (sb, st), (db, dt) = src, dst
    if st.size != dt.size:
        raise BadRequest(f"copy of {st.size} bytes into a tensor of {dt.size}")
    if sb.staging is not None or db.staging is not None:
        return _device_copy(src, dst)
    if st.size > SLICE:
        s, d = sb.array(st.offset, st.size), db.array(dt.offset, dt.size)
        # Overlapping ranges of one buffer: a slice must not overwrite source bytes a
        # later slice reads, so copy towards the overlap.
        backward = sb is db and dt.offset > st.offset
        return sliced([sb.ref(), db.ref()], _copy_steps(s, d, st.size, backward))
    s, d = sb.array(st.offset, st.size), db.array(dt.offset, dt.size)
    if COUNTING:
        count("copy_tensor", st.size)
    np.copyto(d, s)  # handles overlapping ranges in one buffer
    return None


def _device_copy(src: Pair, dst: Pair) -> Awaitable[None]:
    """A copy with a device side: on the device, or through pinned staging.

    Device to device is one copy on the destination's stream (cudaMemcpyDefault:
    any GPU pair under unified addressing).  Host to device and back go through the
    device's pinned staging, chunk by chunk, the host-side copies on the device's
    worker: the loop never waits on a copy from or into pageable memory.
    """
    (sb, st), (db, dt) = src, dst
    sio, dio = sb.staging, db.staging
    s = sb.device_address(st.offset, st.size) if sio is not None else None
    d = db.device_address(dt.offset, dt.size) if dio is not None else None
    sview = sb.view(st.offset, st.size) if sio is None else None
    dview = db.view(dt.offset, dt.size) if dio is None else None
    if (sb is db and st.offset < dt.offset + dt.size and dt.offset < st.offset + st.size
            and st.size):
        # An async device copy between overlapping ranges has no defined result.
        raise BadRequest(f"copy between overlapping ranges of device buffer {sb.id}: "
                         "copy through a second buffer")
    refs = [sb.ref(), db.ref()]

    async def run() -> None:
        try:
            if s is not None and d is not None:
                assert sio is not None and dio is not None
                if sio is not dio:
                    # The source's device may still have work queued on its own
                    # stream (a new buffer's zero fill): that goes first.
                    await sio.waiter.wait(sio.stream.record())
                dio.stream.copy_d2d(d, s, st.size)
                await dio.waiter.wait(dio.stream.record())
            elif d is not None:
                assert dio is not None and sview is not None
                await host_to_device(dio, d, sview)
            else:
                assert sio is not None and s is not None and dview is not None
                await device_to_host(sio, dview, s)
        finally:
            for r in refs:
                r.release()

    return run()


def write(buf: Buffer, t: Tensor, data: memoryview) -> Awaitable[None] | None:
    """``data`` (exactly ``t.size`` bytes) into ``t`` of ``buf``."""
    if data.nbytes != t.size:
        raise BadRequest(f"{data.nbytes} bytes of data for a tensor of {t.size}")
    io = buf.staging
    if io is None:
        buf.view(t.offset, t.size)[:] = data
        if COUNTING:
            count("service.write", t.size)
        return None
    dev = buf.device_address(t.offset, t.size)
    ref = buf.ref()

    async def run() -> None:
        try:
            await host_to_device(io, dev, data)
        finally:
            ref.release()

    return run()


def read(buf: Buffer, t: Tensor, out: memoryview) -> Awaitable[None] | None:
    """``t`` of ``buf`` into ``out`` (exactly ``t.size`` writable bytes)."""
    if out.nbytes != t.size:
        raise BadRequest(f"out= holds {out.nbytes} bytes for a tensor of {t.size}")
    io = buf.staging
    if io is None:
        out[:] = buf.view(t.offset, t.size)
        if COUNTING:
            count("service.read", t.size)
        return None
    dev = buf.device_address(t.offset, t.size)
    ref = buf.ref()

    async def run() -> None:
        try:
            await device_to_host(io, out, dev)
        finally:
            ref.release()

    return run()
