"""Shared memory: a sealed memfd mapped by the daemon and by a local client (``"shm"``).

The daemon creates the memfd, maps it, and passes the fd to the client that
asked (SCM_RIGHTS, over a Unix socket): both then map the same pages, so a
peer's write that lands in the daemon's mapping is in the client's memory,
and the client reads and writes its tensors without a byte on the wire.

The memfd is sealed against shrinking and growing before the fd leaves the
daemon: a client that truncated it would make the daemon's next access to
the missing pages a SIGBUS.

When the daemon lets go of the buffer (FREE_BUFFER, its connection or lease
gone, once nothing holds a Ref) it first punches the whole memfd out
(``MADV_REMOVE`` on its mapping: ``fallocate(PUNCH_HOLE)``, which the seals
allow).  The pages are freed there and then, whoever still has the
descriptor or a mapping: a client that kept them reads zeros, and a page it
touches afterwards (a read too) is a new page, charged to the client's memory
cgroup, not the daemon's.  Without it a client that kept the descriptor kept every page
the daemon had filled alive, outside ``memory.shm_limit_mib`` (240 MiB past a
64 MiB limit in issue 16) and charged to the daemon's cgroup.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
from typing import Any

from transferd.protocol.errors import OutOfMemory

from .base import pages
from .host import MappedMemory

log = logging.getLogger("transferd.memory")

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class SharedMemory(MappedMemory):
    kind = "shm"
    needs_fd_passing = True

    def __init__(self, device: str, size: int, mem: mmap.mmap, fd: int) -> None:
        super().__init__(device, size, mem)
        self._fd = fd
        self.mapped_size = pages(size)

    @classmethod
    def create(cls, device: str, size: int) -> SharedMemory:
        length = pages(size)
        fd = os.memfd_create(f"transferd-{size}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, length)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mem = mmap.mmap(fd, length, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise OutOfMemory(f"cannot create {length} bytes of shared memory: {exc}") from None
        return cls(device, size, mem, fd)

    def fd(self) -> int | None:
        return self._fd if self._fd >= 0 else None

    def handed_over(self) -> None:
        self.close_fd()

    def close_fd(self) -> None:
        """The mappings keep the pages, not the fd: close it once it was handed over.

        Closed at once so that many shared buffers do not hold as many of the
        daemon's descriptors (which it needs to accept connections).
        """
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def describe(self) -> dict[str, Any]:
        # The client maps this many bytes of the fd (whole pages).
        return {"shared": True, "map_size": self.mapped_size}

    def close(self) -> bool:
        self.release_pages()
        self.close_fd()
        return super().close()

    def release_pages(self) -> None:
        """Free every page of the memfd now, mapped or not by anyone else (see above)."""
        mem = self._mmap
        if mem is None or mem.closed:
            return
        try:
            mem.madvise(mmap.MADV_REMOVE)
        except OSError as exc:  # pragma: no cover - every kernel with memfd has it
            # The pages then live as long as the client's mapping or descriptor.
            log.warning("shared buffer of %d bytes: cannot release its pages (%s); they "
                        "stay while a client keeps its descriptor or mapping",
                        self.size, exc)
