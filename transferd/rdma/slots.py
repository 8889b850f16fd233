"""Message slots: host memory in fixed slots, registered with a NIC (SEND/RECV buffers).

Shared by the verbs Domain's send/recv queue pairs and the rdma:// channel.  Needs a
device (a :class:`~.resources.Nic`).
"""

from __future__ import annotations

import contextlib
import mmap

from transferd.protocol.errors import TransferdError

from .mrtable import Registration, address_of
from .resources import Nic, PyverbsError


class Slots:
    """``count`` slots of ``length`` bytes in one registered mapping; ``free`` lists the
    ones not in use."""

    def __init__(self, nic: Nic, count: int, length: int) -> None:
        self.length = length
        self.map = mmap.mmap(-1, count * length)
        self.view = memoryview(self.map)
        self.addr = address_of(self.view)
        # SENDs and RECVs only: no remote right (no peer has or needs its rkey, and a
        # guessed one writes nothing into them).
        self.reg: Registration = nic.register(self.addr, count * length, remote=False)
        self.free = list(range(count - 1, -1, -1))

    def slot(self, i: int) -> memoryview:
        return self.view[i * self.length : (i + 1) * self.length]

    def close(self, nic: Nic) -> None:
        with contextlib.suppress(TransferdError, PyverbsError):
            nic.deregister(self.reg)
        # A slot view still held somewhere keeps the mapping until it goes.
        with contextlib.suppress(BufferError):
            self.view.release()
            self.map.close()
