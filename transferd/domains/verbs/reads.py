"""RDMA READ on a verbs rail, the part that needs no device: access flags, work
requests, the read window.  Pure: no pyverbs import (the numbers are fixed by
<infiniband/verbs.h>, an ABI; tests/unit/test_verbs_reads.py checks them against
pyverbs.enums wherever pyverbs imports).

- :func:`mr_access`, :func:`qp_access`, :func:`rd_atomic` (from
  :mod:`transferd.rdma.access`, where the NIC code uses them): a region's
  ``ibv_reg_mr`` flags from its rights (``IBV_ACCESS_REMOTE_READ`` only with "r"), a
  queue pair's access flags and READ depths.
- :func:`plan_read`: a :class:`~transferd.parts.ReadPart` as ``IBV_WR_RDMA_READ`` work
  requests: one per contiguous remote range (at most ``max_msg`` bytes), scattered into
  at most ``max_sge`` local pieces of the reader's registered region.
- :class:`ReadWindow`: at most ``max_rd_atomic`` READs posted per queue pair; the rest
  wait, in order and bounded, so that READs never sit in the send queue in front of the
  writes behind them.

Posted by :meth:`~.sender.Sender.read` on the write queue pair (``domain.py``); the
numbers below are also :class:`~transferd.rdma.constants.WrOpcode` / ``WcOpcode``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transferd.parts import ReadPart
from transferd.protocol.errors import BadRequest, OverLimit
from transferd.rdma.access import IBV_ACCESS_REMOTE_READ, mr_access, qp_access, rd_atomic
from transferd.rdma.mrtable import address_of
from transferd.rdma.wrplan import LkeyOf, Sge

# enum ibv_wr_opcode / ibv_wc_opcode
IBV_WR_RDMA_READ = 4
IBV_WC_RDMA_READ = 2

# READs waiting for the window, per queue pair, before a new one is refused: 64 GiB of
# READ_MAX reads (a few hundred bytes each while they wait).
MAX_WAITING = 1 << 16
# The largest READ posted, whatever the port's max_msg_sz (often 2 GiB): the window
# then pipelines a large part, and a read that ended early has at most
# max_rd_atomic * READ_MAX bytes per queue pair still landing (nothing can recall a
# posted READ).
READ_MAX = 1 << 20


@dataclass(slots=True)
class ReadWr:
    """One ``IBV_WR_RDMA_READ``: the remote range into the local pieces."""

    remote_addr: int
    rkey: int
    sges: list[Sge]
    opcode: int = IBV_WR_RDMA_READ

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self.sges)


def plan_read(part: ReadPart, lkey_of: LkeyOf, *, max_msg: int, max_sge: int
              ) -> list[ReadWr]:
    """``part``'s work requests: each remote page (``addrs``/``lens``) read into the
    next bytes of ``into`` (the local views, concatenated), cut so that no request is
    over ``max_msg`` bytes or ``max_sge`` local pieces.  ``lkey_of(addr, len)`` is the
    local registration's lkey (NotFound for memory not registered on this NIC)."""
    if max_msg < 1 or max_sge < 1:
        raise BadRequest(f"a device with max_msg {max_msg} and max_sge {max_sge}")
    total = sum(part.lens)
    if sum(len(v) for v in part.into) != total:
        raise BadRequest(f"a read of {total} bytes into {sum(len(v) for v in part.into)}")
    wrs: list[ReadWr] = []
    vi, voff = 0, 0  # where in the local views the next byte goes
    views = part.into
    for addr, length in zip(part.addrs, part.lens, strict=True):
        left = length
        while left:
            sges: list[Sge] = []
            take = min(left, max_msg)
            start = addr + (length - left)
            got = 0
            while got < take and len(sges) < max_sge:
                v = views[vi]
                k = min(len(v) - voff, take - got)
                local = address_of(v) + voff
                sges.append((local, k, lkey_of(local, k)))
                got += k
                voff += k
                if voff == len(v):
                    vi, voff = vi + 1, 0
            wrs.append(ReadWr(start, part.rkey, sges))
            left -= got
    return wrs


class ReadWindow:
    """At most ``depth`` READs in flight on one queue pair (its max_rd_atomic): what
    :meth:`offer` is given beyond that waits, in order, and :meth:`done` lets the next
    one go (``post`` is called with it).  At most ``max_waiting`` wait."""

    def __init__(self, depth: int, post: Callable[[Any], None],
                 max_waiting: int = MAX_WAITING) -> None:
        if depth < 1:
            raise ValueError("a read window of at least one")
        self.depth = depth
        self.in_flight = 0
        self._post = post
        self._waiting: deque[Any] = deque()
        self.max_waiting = max_waiting
        self._pumping = False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def offer(self, wr: Any) -> None:
        if self.in_flight < self.depth:
            self.in_flight += 1
            self._post(wr)
        elif len(self._waiting) >= self.max_waiting:
            raise OverLimit(f"{len(self._waiting)} RDMA READs wait for this queue pair's "
                            f"{self.depth} read slots")
        else:
            self._waiting.append(wr)

    def done(self) -> None:
        """One READ completed (or failed, or was dropped): the next waiting ones are
        posted.  A ``post`` that gives its slot straight back (calls done) is met by
        this loop, not by a recursion as deep as the waiting queue."""
        self.in_flight -= 1
        if self._pumping:
            return
        self._pumping = True
        try:
            while self._waiting and self.in_flight < self.depth:
                self.in_flight += 1
                self._post(self._waiting.popleft())
        finally:
            self._pumping = False

    def drain(self) -> list[Any]:
        """The queue pair closed: what still waits (to fail), none posted."""
        out = list(self._waiting)
        self._waiting.clear()
        return out


__all__ = [
    "IBV_ACCESS_REMOTE_READ",
    "IBV_WC_RDMA_READ",
    "IBV_WR_RDMA_READ",
    "READ_MAX",
    "ReadWindow",
    "ReadWr",
    "mr_access",
    "plan_read",
    "qp_access",
    "rd_atomic",
]
