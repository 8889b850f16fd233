"""Local memory registrations of one NIC: which lkey covers an address.

A work request's scatter/gather entries name local memory by (address, length,
lkey); the source views of a write part are plain memoryviews, so the Domain looks up
the registration that holds each one.  Lookups are a bisect over the registrations'
starts.

The same memory may be registered more than once (a second ``reg_mr`` of one buffer, as
tcp allows: each region has its own rkey, revoked on its own), so one range holds a
stack of registrations, any of whose lkeys serves a local read; each is removed by
identity.  Ranges that overlap without being the same are refused: no region is part of
another.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from transferd.protocol.errors import BadRequest, NotFound


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
        # Per start, the registrations of that very range (the first serves lookups).
        self._regs: list[list[Registration]] = []

    def add(self, reg: Registration) -> None:
        i = bisect.bisect_left(self._starts, reg.addr)
        if i < len(self._starts) and self._starts[i] == reg.addr:
            same = self._regs[i]
            if same[0].length == reg.length:
                same.append(reg)
                return
            raise BadRequest(f"registration [0x{reg.addr:x}, +{reg.length}) overlaps "
                             f"[0x{reg.addr:x}, +{same[0].length}) on this NIC")
        if i and self._regs[i - 1][0].end > reg.addr:
            other = self._regs[i - 1][0]
        elif i < len(self._regs) and self._regs[i][0].addr < reg.end:
            other = self._regs[i][0]
        else:
            self._starts.insert(i, reg.addr)
            self._regs.insert(i, [reg])
            return
        raise BadRequest(f"registration [0x{reg.addr:x}, +{reg.length}) overlaps "
                         f"[0x{other.addr:x}, +{other.length}) on this NIC")

    def remove(self, reg: Registration) -> Registration:
        """Take ``reg`` (this very registration) out of the table."""
        i = bisect.bisect_left(self._starts, reg.addr)
        if i < len(self._starts) and self._starts[i] == reg.addr:
            same = self._regs[i]
            for k, r in enumerate(same):
                if r is reg:
                    del same[k]
                    if not same:
                        del self._starts[i]
                        del self._regs[i]
                    return reg
        raise NotFound(f"no registration [0x{reg.addr:x}, +{reg.length}) on this NIC")

    def find(self, addr: int, length: int) -> Registration:
        """A registration holding all of [addr, addr + length)."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0:
            reg = self._regs[i][0]
            if addr + length <= reg.end:
                return reg
        raise NotFound(f"[0x{addr:x}, +{length}) is not inside memory registered with this NIC")

    def __len__(self) -> int:
        return sum(map(len, self._regs))

    def __iter__(self) -> Iterator[Registration]:
        return iter([r for same in self._regs for r in same])
