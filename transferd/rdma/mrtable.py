"""Local memory registrations of one NIC: which lkey covers an address.

A work request's scatter/gather entries name local memory by (address, length,
lkey); the source views of a write part are plain memoryviews, so the Domain looks up
the registration that holds each one.  Registrations never overlap within a table
(one per region per NIC); lookups are a bisect.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from transferd.protocol.errors import NotFound


def address_of(view: memoryview) -> int:
    """The address of a memoryview's first byte (read-only and empty views too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


@dataclass(frozen=True, slots=True)
class Registration:
    addr: int
    length: int
    lkey: int
    rkey: int
    handle: Any = None  # the pyverbs MR (kept alive while registered)

    @property
    def end(self) -> int:
        return self.addr + self.length


class MrTable:
    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regs: list[Registration] = []

    def add(self, reg: Registration) -> None:
        i = bisect.bisect_right(self._starts, reg.addr)
        if (i and self._regs[i - 1].end > reg.addr) or (
                i < len(self._regs) and self._regs[i].addr < reg.end):
            raise ValueError(f"registration [0x{reg.addr:x}, +{reg.length}) overlaps another")
        self._starts.insert(i, reg.addr)
        self._regs.insert(i, reg)

    def remove(self, addr: int) -> Registration:
        i = bisect.bisect_left(self._starts, addr)
        if i == len(self._starts) or self._starts[i] != addr:
            raise NotFound(f"no registration at 0x{addr:x}")
        del self._starts[i]
        return self._regs.pop(i)

    def find(self, addr: int, length: int) -> Registration:
        """The registration holding all of [addr, addr + length)."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            reg = self._regs[i]
            if addr + length <= reg.end:
                return reg
        raise NotFound(f"[0x{addr:x}, +{length}) is not inside memory registered with this NIC")

    def __len__(self) -> int:
        return len(self._regs)

    def __iter__(self) -> Iterator[Registration]:
        return iter(list(self._regs))
