"""Completion dispatch: what each completion-queue entry means, without a device.

The Domain's completion-queue loop polls pyverbs WCs, turns each into a
:class:`Completion` and hands it to :class:`Dispatcher`, which

* for a work request we posted (RDMA WRITE, WRITE_WITH_IMM, SEND) finds what it
  belonged to by its ``wr_id`` and reports it done or failed;
* for a RECV_RDMA_WITH_IMM on a write queue pair, adds 1 to the immediate's counter
  (through ``on_imm``) and reposts that receive;
* for a RECV on a send/recv queue pair, hands the message in its slot to ``on_message``,
  which reposts the slot once the bytes were taken;
* for a receive that failed (the queue pair went to the error state: the peer is gone
  or broke the protocol) reports the link broken and does not repost.

``wr_id`` packs a kind in its top byte and an index below it.  Indices of posted sends
come from :class:`WrIds`, a bounded table; receive slots are fixed per queue pair.
"""

from __future__ import annotations

import enum
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from transferd.protocol.errors import NotFound, PeerUnreachable, TransferdError

from .constants import IBV_WC_WITH_IMM, WcOpcode, WcStatus, status_name

log = logging.getLogger("transferd.verbs")
T = TypeVar("T")


class WrKind(enum.IntEnum):
    SEND = 1  # a work request we posted on a send queue
    RECV = 2  # a receive slot of a send/recv queue pair
    WRITE_RECV = 3  # a receive slot of a write queue pair (consumed by WRITE_WITH_IMM)


_SHIFT = 56
_MASK = (1 << _SHIFT) - 1


def wr_id(kind: WrKind, index: int) -> int:
    if not 0 <= index <= _MASK:
        raise ValueError(f"wr_id index {index} out of range")
    return (int(kind) << _SHIFT) | index


def split_wr_id(value: int) -> tuple[WrKind | None, int]:
    try:
        return WrKind(value >> _SHIFT), value & _MASK
    except ValueError:
        return None, value & _MASK


def wc_error(status: int) -> TransferdError:
    """What a failed work request of ours means for its part.  REM_ACCESS_ERR is the
    peer's NIC answering "no" (an unknown or revoked rkey, a region without that right:
    a READ of a region registered "w", a WRITE into one registered "r"): NOT_FOUND, as
    tcp answers, and not retried on another rail (it would answer alike).  Anything
    else (retries exhausted, a flush, ...) is PEER_UNREACHABLE: failover tries another
    rail."""
    if status == WcStatus.REM_ACCESS_ERR:
        return NotFound("the peer refused the access (REM_ACCESS_ERR): an unknown or "
                        "revoked rkey, or a region without that right")
    return PeerUnreachable(f"work request failed: {status_name(status)}")


@dataclass(frozen=True, slots=True)
class Completion:
    """One work completion, as recorded (tests) or read from a pyverbs WC."""

    wr_id: int
    status: int
    opcode: int
    qp_num: int = 0
    byte_len: int = 0
    imm_data: int = 0  # network order, as the WC holds it
    wc_flags: int = 0

    @classmethod
    def from_wc(cls, wc: Any) -> Completion:
        return cls(wc.wr_id, wc.status, wc.opcode, wc.qp_num, wc.byte_len, wc.imm_data,
                   wc.wc_flags)

    @property
    def imm(self) -> int:
        """The immediate in host order."""
        return socket.ntohl(self.imm_data)


class WrIds(Generic[T]):
    """A bounded table from posted work requests' indices to what they belong to."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: dict[int, T] = {}
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    def put(self, item: T) -> int:
        if not self._free:
            raise OverflowError(f"more than {self.capacity} work requests in flight")
        index = self._free.pop()
        self._items[index] = item
        return index

    def pop(self, index: int) -> T | None:
        item = self._items.pop(index, None)
        if item is not None:
            self._free.append(index)
        return item

    def drain(self) -> list[T]:
        items = list(self._items.values())
        self._items.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        return items

    def __len__(self) -> int:
        return len(self._items)


@dataclass(slots=True)
class QpRole:
    """What the dispatcher knows of one local queue pair."""

    peer: Any  # the peer's key, passed back to the callbacks
    write: bool  # a write queue pair (its receives count immediates)


class Dispatcher(Generic[T]):
    def __init__(
        self,
        sends: WrIds[T],
        *,
        on_send_done: Callable[[T, TransferdError | None], None],
        on_imm: Callable[[Any, int, int], None],
        on_message: Callable[[Any, int, int, int], None],
        repost: Callable[[int, int], None],
        on_broken: Callable[[Any, str], None],
        on_credits: Callable[[Any, int], None] | None = None,
    ) -> None:
        """``on_credits(peer, imm)``: a message received with an immediate (rdma://'s
        credit returns), before ``on_message``; where it is None an immediate on a
        message is ignored."""
        self.sends = sends
        self.qps: dict[int, QpRole] = {}
        self._on_send_done = on_send_done
        self._on_imm = on_imm  # (peer, imm, byte_len)
        self._on_message = on_message  # (peer, qp_num, slot, byte_len)
        self._repost = repost  # (qp_num, slot) for write receives
        self._on_broken = on_broken
        self._on_credits = on_credits
        self.counted = 0
        self.unknown = 0

    def dispatch(self, c: Completion) -> None:
        kind, index = split_wr_id(c.wr_id)
        if kind is WrKind.SEND:
            item = self.sends.pop(index)
            if item is None:
                self.unknown += 1
                log.warning("completion for unknown work request %#x", c.wr_id)
                return
            self._on_send_done(item, None if c.status == WcStatus.SUCCESS
                               else wc_error(c.status))
            return
        role = self.qps.get(c.qp_num)
        if role is None or kind is None:
            self.unknown += 1
            log.warning("completion on unknown queue pair %d (wr_id %#x)", c.qp_num, c.wr_id)
            return
        if c.status != WcStatus.SUCCESS:
            # Flushed receives (the queue pair was closed) are expected once per slot.
            if c.status != WcStatus.WR_FLUSH_ERR:
                self._on_broken(role.peer, f"receive failed: {status_name(c.status)}")
            return
        if kind is WrKind.WRITE_RECV and role.write:
            if c.opcode != WcOpcode.RECV_RDMA_WITH_IMM:
                # Only WRITE_WITH_IMM belongs on a write queue pair.
                self._on_broken(role.peer, f"unexpected opcode {c.opcode} on a write QP")
                return
            self.counted += 1
            self._repost(c.qp_num, index)
            self._on_imm(role.peer, c.imm, c.byte_len)
        elif kind is WrKind.RECV and not role.write:
            if c.opcode != WcOpcode.RECV:
                self._on_broken(role.peer, f"unexpected opcode {c.opcode} on a send QP")
                return
            if self._on_credits is not None and c.wc_flags & IBV_WC_WITH_IMM:
                self._on_credits(role.peer, c.imm)
            self._on_message(role.peer, c.qp_num, index, c.byte_len)
        else:
            self._on_broken(role.peer, f"completion of kind {kind.name} on the wrong QP")
