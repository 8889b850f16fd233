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
  unified addressing); host to device and back through pinned staging, the
  host-side copies on the device's worker (never a copy from pageable memory
  that would hold the loop).

Staging goes back to its pool only once the device is done with it, however
the operation ended (staging.Claim); a copy the device failed (DeviceFault)
fails its command, and a GET it fails mid-reply closes the connection.
Per-connection state (the staged SET frames) is the session's ``landings``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transferd.copies import COUNTING, count
from transferd.memory.base import Ref
from transferd.memory.staging import (
    Claim,
    DeviceIO,
    StagingChunk,
    device_to_wire,
    host_to_device,
)
from transferd.protocol.constants import HEADER_SIZE
from transferd.protocol.errors import BadRequest, ConnectionLost
from transferd.protocol.frames import Frame, Sink
from transferd.protocol.messages import Tensor

if TYPE_CHECKING:
    from transferd.memory import Buffer

    from .session import Session

Pair = tuple["Buffer", Tensor]


# -- SET ----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Landing:
    """A SET frame's device pieces, staged by its sink, waiting for its handler."""

    pieces: list[tuple[DeviceIO, int, StagingChunk, int, int]] = field(default_factory=list)
    # The staging it holds, per device: back once the copies on it ended.
    claims: dict[int, Claim] = field(default_factory=dict)
    refs: list[Ref] = field(default_factory=list)
    collected: list[tuple[Pair, int]] = field(default_factory=list)  # (pair, payload offset)
    done: bool = False

    def claim(self, io: DeviceIO) -> Claim:
        c = self.claims.get(id(io))
        if c is None:
            c = self.claims[id(io)] = Claim(io)
        return c

    def unstage(self) -> None:
        """Give back staging nothing was enqueued on (the sink found too little)."""
        for c in self.claims.values():
            c.release()
        self.claims.clear()
        self.pieces.clear()

    def release(self) -> None:
        if not self.done:
            self.done = True
            for c in self.claims.values():
                c.release()
            for r in self.refs:
                r.release()

    def __del__(self) -> None:
        # A frame whose connection died mid-payload never reaches its handler.
        self.release()


class Landings:
    """One connection's SET frames whose payload went to staging, by seq, until their
    handler runs; it goes with the connection (ownership.session_closed closes it)."""

    def __init__(self) -> None:
        self._by_seq: dict[int, _Landing] = {}

    def __bool__(self) -> bool:
        return bool(self._by_seq)

    def put(self, seq: int, landing: _Landing) -> None:
        old = self._by_seq.pop(seq, None)
        if old is not None:
            old.release()
        self._by_seq[seq] = landing

    def take(self, seq: int) -> _Landing | None:
        return self._by_seq.pop(seq, None)

    def close(self) -> None:
        landings, self._by_seq = self._by_seq, {}
        for landing in landings.values():
            landing.release()


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
    session.landings.put(frame.seq, landing)
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
    last: DeviceIO | None = None
    used = 0
    for buf, t in pairs:
        io = buf.staging
        if io is None:
            views.append(buf.view(t.offset, t.size))
            continue
        dev = buf.device_address(t.offset, t.size)
        left, pos = t.size, 0
        while left:
            if chunk is None or used == chunk.size or last is not io:
                chunk = landing.claim(io).try_take()
                if chunk is None:
                    landing.unstage()
                    views.clear()
                    return False
                last, used = io, 0
            n = min(left, chunk.size - used)
            views.append(chunk.view[used : used + n])
            landing.pieces.append((io, dev + pos, chunk, used, n))
            used += n
            pos += n
            left -= n
    return True


def finish_set(session: Session, frame: Frame) -> Awaitable[None] | None:
    """The SET's handler half: copy staged bytes to their devices, finish when there."""
    landing = session.landings.take(frame.seq) if session.landings else None
    if landing is None:
        return None
    return _land(landing, frame.payload)


async def _land(landing: _Landing, payload: bytearray | None) -> None:
    try:
        waits: list[Awaitable[None]] = []
        for io, dev, chunk, off, n in landing.pieces:
            io.stream.copy_h2d(dev, chunk.ptr + off, n)
        for claim in landing.claims.values():
            waits.append(claim.settle())
        if landing.collected and payload is not None:
            src = memoryview(payload)
            for (buf, t), pos in landing.collected:
                bio = buf.staging
                if bio is None:
                    buf.view(t.offset, t.size)[:] = src[pos : pos + t.size]
                    if COUNTING:
                        count("device_io.collected", t.size)
                    continue
                waits.append(host_to_device(bio, buf.device_address(t.offset, t.size),
                                            src[pos : pos + t.size]))
        if waits:
            # A failed copy (DeviceFault) fails the SET: it is never answered ok.
            await asyncio.gather(*waits)
    finally:
        landing.release()  # the staging goes back once its copies ended


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
    ptrs = [None if b.staging is None else b.device_address(t.offset, t.size)
            for b, t in pairs]
    for (b, t), p in zip(pairs, ptrs, strict=True):
        if p is None:
            b.view(t.offset, t.size)

    async def stream() -> Reply:
        transport = session.transport
        try:
            if transport is None or transport.is_closing():
                raise ConnectionLost("the client went away before the GET")
            head = session.stream_head(frame, total)
            session.hold_frames()  # no other frame inside this payload (session.py)
            transport.write(head)

            async def send(view: memoryview) -> None:
                transport.write(view)
                await _drained(session)

            for (buf, t), ptr in zip(pairs, ptrs, strict=True):
                io = buf.staging
                if io is None or ptr is None:
                    await send(buf.view(t.offset, t.size))
                else:
                    # A failed device copy raises here: the reply is cut (closed) below.
                    await device_to_wire(io, ptr, t.size, send)
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
            session.release_frames()
            for r in refs:
                r.release()
        return Reply(sent=True)

    return stream()


# COPY_TENSOR and BUFFER_CLEAR with a device side are the Service's
# (transferd/service/tensors.py), for the inproc client as for these handlers.


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
    buf = session.ctx.service.adopt_memory(
        session.caller, device, size, lambda: source.open_ipc(handle, offset, size))
    return Reply({"buffer": buf.id, "size": buf.size, "ipc": True})
