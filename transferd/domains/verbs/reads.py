"""RDMA READ on a verbs rail, the part that needs no device: access flags, work
requests, the read window.  Pure: no pyverbs import (the numbers are fixed by
<infiniband/verbs.h>, an ABI; tests/unit/test_verbs_reads.py checks them against
pyverbs.enums wherever pyverbs imports).

- :func:`mr_access`: a region's ``ibv_reg_mr`` access flags from its rights.
  ``IBV_ACCESS_REMOTE_READ`` only where ``"r"`` was granted, ``IBV_ACCESS_REMOTE_WRITE``
  only where ``"w"`` was: the NIC itself then refuses (REM_ACCESS_ERR at the reader) a
  read of a write-only region, as the tcp responder refuses it (NOT_FOUND).
- :func:`plan_read`: a :class:`~transferd.parts.ReadPart` as ``IBV_WR_RDMA_READ`` work
  requests: one per contiguous remote range (at most ``max_msg`` bytes), scattered into
  at most ``max_sge`` local pieces of the reader's registered region.
- :func:`rd_atomic`: the queue pair's ``max_rd_atomic`` (READs this side has in flight)
  and ``max_dest_rd_atomic`` (the peer's READs it serves at once), within what the
  device allows (``max_qp_init_rd_atom`` / ``max_qp_rd_atom``).
- :class:`ReadWindow`: at most ``max_rd_atomic`` READs posted per queue pair; the rest
  wait, in order and bounded, so that READs never sit in the send queue in front of the
  writes behind them.

Not wired yet: the verbs Domain refuses a ReadPart (BadRequest) until the posting and
completion of these work requests (``IBV_WC_RDMA_READ``) are built on a device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transferd.parts import ReadPart
from transferd.protocol.errors import BadRequest, OverLimit
from transferd.rdma.mrtable import address_of
from transferd.rdma.wrplan import LkeyOf, Sge

# enum ibv_access_flags
IBV_ACCESS_LOCAL_WRITE = 1
IBV_ACCESS_REMOTE_WRITE = 2
IBV_ACCESS_REMOTE_READ = 4
IBV_ACCESS_RELAXED_ORDERING = 1 << 20  # IBV_ACCESS_OPTIONAL_FIRST
# enum ibv_wr_opcode / ibv_wc_opcode
IBV_WR_RDMA_READ = 4
IBV_WC_RDMA_READ = 2

# What a queue pair asks for at most (the device may allow fewer).
WANT_RD_ATOMIC = 16
# READs waiting for the window, per queue pair, before a new one is refused.
MAX_WAITING = 4096


def mr_access(access: str) -> int:
    """``ibv_reg_mr`` flags for a region with rights ``access`` ("w", "r", "rw")."""
    if access not in ("w", "r", "rw"):
        raise BadRequest(f"access {access!r} is not one of 'w', 'r' or 'rw'")
    flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING
    if "w" in access:
        flags |= IBV_ACCESS_REMOTE_WRITE
    if "r" in access:
        flags |= IBV_ACCESS_REMOTE_READ
    return flags


def qp_access(serves_reads: bool) -> int:
    """A queue pair's ``qp_access_flags``: remote reads only on one that serves them."""
    flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE
    return flags | IBV_ACCESS_REMOTE_READ if serves_reads else flags


def rd_atomic(max_qp_init_rd_atom: int, max_qp_rd_atom: int,
              want: int = WANT_RD_ATOMIC) -> tuple[int, int]:
    """(max_rd_atomic, max_dest_rd_atomic) for a queue pair on this device: as many as
    asked, at most what it allows, at least 1 (the RC minimum)."""
    return (max(1, min(want, max_qp_init_rd_atom)), max(1, min(want, max_qp_rd_atom)))


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
        """One READ completed (or failed): the next waiting one is posted."""
        self.in_flight -= 1
        if self._waiting:
            self.in_flight += 1
            self._post(self._waiting.popleft())

    def drain(self) -> list[Any]:
        """The queue pair closed: what still waits (to fail), none posted."""
        out = list(self._waiting)
        self._waiting.clear()
        return out


__all__ = ["IBV_ACCESS_REMOTE_READ", "IBV_WC_RDMA_READ", "IBV_WR_RDMA_READ", "ReadWindow",
           "ReadWr", "mr_access", "plan_read", "qp_access", "rd_atomic"]
