"""Buffers the daemon hands out to clients, and the table that owns them.

Host buffers are anonymous ``mmap`` regions: page aligned, zero filled, backed
lazily by the kernel, and addressable by ``memoryview`` so sockets can read
into and send from them without copies.  Every access goes through
:meth:`Buffer.view`, which checks ``offset + size`` against the buffer before
any memory is touched.
"""

from __future__ import annotations

import itertools
import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from transferd.protocol.errors import BadRequest, NotFound, OutOfBounds, OutOfMemory
from transferd.protocol.messages import Tensor

PAGE = mmap.PAGESIZE


@dataclass(eq=False)
class Buffer:
    id: int
    device: str
    size: int
    _mem: mmap.mmap | None = field(repr=False, default=None)
    _view: memoryview | None = field(repr=False, default=None)

    @classmethod
    def host(cls, buffer_id: int, size: int) -> Buffer:
        # mmap refuses length 0; a zero-size buffer is legal and simply empty.
        mem = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return cls(buffer_id, "cpu", size, mem, memoryview(mem)[:size])

    @property
    def address(self) -> int:
        """The buffer's virtual address (what an MrDesc's ``ptr`` names)."""
        assert self._view is not None
        return int(np.frombuffer(self._view, dtype=np.uint8).ctypes.data) if self.size else 0

    def check(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise OutOfBounds(
                f"[{offset}, {offset + size}) is outside buffer {self.id} of {self.size} bytes"
            )

    def view(self, offset: int, size: int) -> memoryview:
        if offset < 0 or size < 0 or offset + size > self.size:
            self.check(offset, size)  # raises OutOfBounds (inlined test: once per tensor)
        if self._view is None:
            raise NotFound(f"buffer {self.id} was freed")
        return self._view[offset : offset + size]

    def views(self, offsets: Sequence[int], size: int) -> list[memoryview]:
        """``size`` bytes at each of ``offsets``: one bounds check for the whole list."""
        if not offsets:
            return []
        self.check(min(offsets), size)
        self.check(max(offsets), size)
        view = self._view
        if view is None:
            raise NotFound(f"buffer {self.id} was freed")
        return [view[o : o + size] for o in offsets]

    def array(self, offset: int, size: int) -> np.ndarray:
        return np.frombuffer(self.view(offset, size), dtype=np.uint8)

    def clear(self, value: int) -> None:
        if not 0 <= value <= 255:
            raise BadRequest(f"clear value {value} is not a byte (0-255)")
        if self.size:
            self.array(0, self.size).fill(value)

    def release(self) -> None:
        """Drop our references; memory goes back once in-flight sends let go."""
        self._view = None
        self._mem = None


class BufferTable:
    """All buffers of one daemon, shared by its connections, under a memory cap."""

    def __init__(self, host_limit: int, max_size: int | None = None) -> None:
        self.host_limit = host_limit
        self.max_size = max_size if max_size is not None else host_limit
        self._buffers: dict[int, Buffer] = {}
        self._ids = itertools.count(1)
        self._used = 0
        # Engine workers run in their own threads and look buffers up too.
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    @property
    def free(self) -> int:
        return self.host_limit - self._used

    def alloc(self, device: str, size: int) -> Buffer:
        if device != "cpu":
            raise NotFound(f"no device {device!r} on this daemon (have: cpu)")
        if size > self.max_size:
            raise OutOfMemory(f"{size} bytes is over the largest buffer of {self.max_size}")
        with self._lock:
            if size > self.free:
                raise OutOfMemory(
                    f"{size} bytes requested, {self.free} of {self.host_limit} free on cpu"
                )
            self._used += size
            buffer_id = next(self._ids)
        try:
            buf = Buffer.host(buffer_id, size)
        except (OSError, ValueError) as exc:
            with self._lock:
                self._used -= size
            raise OutOfMemory(f"cannot map {size} bytes: {exc}") from None
        with self._lock:
            self._buffers[buffer_id] = buf
        return buf

    def get(self, buffer_id: int) -> Buffer:
        try:
            return self._buffers[buffer_id]
        except KeyError:
            raise NotFound(f"no buffer {buffer_id}") from None

    def free_buffer(self, buffer_id: int) -> Buffer:
        with self._lock:
            buf = self._buffers.pop(buffer_id, None)
            if buf is None:
                raise NotFound(f"no buffer {buffer_id}")
            self._used -= buf.size
        buf.release()
        return buf

    def tensor_view(self, t: Tensor) -> memoryview:
        return self.get(t.buffer).view(t.offset, t.size)

    def copy(self, src: Tensor, dst: Tensor) -> None:
        if src.size != dst.size:
            raise BadRequest(f"copy of {src.size} bytes into a tensor of {dst.size}")
        s = self.get(src.buffer).array(src.offset, src.size)
        d = self.get(dst.buffer).array(dst.offset, dst.size)
        np.copyto(d, s)  # handles overlapping ranges in one buffer

    def close(self) -> None:
        with self._lock:
            for buf in self._buffers.values():
                buf.release()
            self._buffers.clear()
            self._used = 0

    def __len__(self) -> int:
        return len(self._buffers)
