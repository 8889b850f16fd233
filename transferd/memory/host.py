"""Host memory: anonymous ``mmap`` regions (device ``"cpu"``).

Page aligned, zero filled, backed lazily by the kernel, and addressable by
``memoryview`` so sockets read into and send from them without copies.
"""

from __future__ import annotations

import mmap
import weakref
from typing import Any

import numpy as np

from transferd.protocol.errors import OutOfMemory

from .base import Memory, pages


class MappedMemory(Memory):
    """A Memory that is one ``mmap`` object: what host and shared memory have in common.

    Every view handed out is a slice of ``host_view``, so it keeps the mmap
    object alive: the mapping goes (and ``gone`` is reported) when our own
    reference and every view are gone, never while someone can still touch it.
    """

    def __init__(self, device: str, size: int, mem: mmap.mmap) -> None:
        super().__init__(device, size)
        self._mmap: mmap.mmap | None = mem
        self._view: memoryview | None = memoryview(mem)[:size]
        self._addr = int(np.frombuffer(self._view, dtype=np.uint8).ctypes.data) if size else 0
        self._finalizer: weakref.finalize[Any, Any] = self._track(mem)

    @property
    def host_view(self) -> memoryview | None:
        return self._view

    @property
    def address(self) -> int:
        return self._addr

    def resident(self) -> int:
        return pages(self.size)

    def close(self) -> bool:
        view, self._view = self._view, None
        mem, self._mmap = self._mmap, None
        if mem is None:
            return True
        try:
            if view is not None:
                view.release()
            mem.close()
        except BufferError:
            # Someone still holds a view that took no Ref: the mapping lives
            # until that view goes, and so does the charge (the finalizer).
            return False
        self._finalizer()  # unmapped now: report gone at once
        return True


class HostMemory(MappedMemory):
    kind = "cpu"

    @classmethod
    def create(cls, device: str, size: int) -> HostMemory:
        # mmap refuses length 0; a zero-size buffer is legal and simply empty.
        try:
            mem = mmap.mmap(-1, pages(size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError, OverflowError) as exc:
            raise OutOfMemory(f"cannot map {size} bytes: {exc}") from None
        return cls(device, size, mem)
