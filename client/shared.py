"""Shared buffers on the client side: the daemon's memfd, mapped here too.

``Client.alloc_buffer(size, device="shm")`` over a unix:// or seqpacket://
connection gets a :class:`SharedBuffer`: the daemon sends the buffer's memfd
with the ALLOC_BUFFER reply (SCM_RIGHTS), and the client maps the same pages.
``buf.array`` (numpy, uint8) and ``buf.view`` (memoryview) are that memory:
what a remote daemon writes into the buffer (after ``reg_mr``) is there with
no copy, and ``set_tensor`` / ``get_tensor`` on it copy within this process,
with no payload on the wire.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transferd.copies import COUNTING, count
from transferd.protocol.errors import BadFrame, BadRequest, OutOfBounds
from transferd.protocol.messages import Tensor

from .buffers import RemoteBuffer
from .replies import out_view


@dataclass(frozen=True)
class SharedBuffer(RemoteBuffer):
    """A buffer in shared memory: the daemon's pages, mapped in this process."""

    mapping: mmap.mmap | None = field(default=None, repr=False, compare=False)

    @property
    def view(self) -> memoryview:
        """The buffer's bytes, writable, in place."""
        if self.mapping is None or self.mapping.closed:
            raise BadRequest(f"shared buffer {self.id} is no longer mapped")
        return memoryview(self.mapping)[: self.size]

    @property
    def array(self) -> np.ndarray:
        """The buffer as a numpy uint8 array over the same memory (no copy)."""
        return np.frombuffer(self.view, dtype=np.uint8)

    def local(self, offset: int, size: int) -> memoryview:
        """``size`` bytes at ``offset``, bounds checked as the daemon checks them."""
        if offset < 0 or size < 0 or offset + size > self.size:
            raise OutOfBounds(
                f"[{offset}, {offset + size}) is outside buffer {self.id} of {self.size} bytes")
        return self.view[offset : offset + size]

    def unmap(self) -> None:
        """Let go of the mapping; arrays still over it keep it until they go."""
        m = self.mapping
        if m is not None and not m.closed:
            with contextlib.suppress(BufferError):
                m.close()


def map_shared(buffer_id: int, size: int, device: str, body: dict[str, Any],
               fds: Sequence[int]) -> SharedBuffer:
    """Map the memfd of an ALLOC_BUFFER reply; every descriptor given is closed."""
    try:
        if len(fds) != 1:
            raise BadFrame(f"a shared buffer comes with one descriptor, got {len(fds)}")
        map_size = body.get("map_size")
        if not isinstance(map_size, int) or map_size < max(size, 1):
            raise BadFrame(f"shared buffer {buffer_id}: map_size {map_size!r} for {size} bytes")
        fd = fds[0]
        st = os.fstat(fd)
        if st.st_size < map_size:
            raise BadFrame(f"shared buffer {buffer_id}: the descriptor holds {st.st_size} bytes, "
                           f"{map_size} announced")
        mapping = mmap.mmap(fd, map_size, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    return SharedBuffer(buffer_id, size, device, mapping)


def read_local(buf: SharedBuffer, t: Tensor, out: Any) -> Any:
    """A shared buffer's tensor, copied out of this process's mapping (into ``out``)."""
    src = buf.local(t.offset, t.size)
    if COUNTING:
        count("client.shared_get", t.size)
    if out is None:
        return bytearray(src)
    out_view(t, out)[:] = src
    return out
