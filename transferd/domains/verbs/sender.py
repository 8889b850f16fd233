"""The initiator side of the verbs Domain, without a device: parts in, work requests
out, completions back to transfers.

For each write part, :class:`Sender` plans its work requests (``wrplan``), queues the
plain ones on the link's send queue and gives each unit's carrier to the group's
:class:`~.counting.CarrierGate`, which releases it onto the send queue once the unit's
other work requests completed.  A part is done when all its work requests (its carrier
included, where it holds one) completed; the first failure fails its transfer.

For each read part, :meth:`Sender.read` plans its ``IBV_WR_RDMA_READ`` work requests
(``reads.plan_read``) and offers them to the queue pair's :class:`~.reads.ReadWindow`
(at most max_rd_atomic in flight), which lets them onto the send queue.  The part is
done when its last READ completed.  Each READ's record holds the reader's views until
its own completion (success, error or flush) arrived: the NIC writes into that memory
until then, whatever became of the transfer meanwhile (failed by another part, timed
out), so it stays mapped until then (docs/memory.md: a Memory is returned only once no
view of it is left).

A *link* is one queue pair of one peer: it owns a :class:`~.sendq.SendQueue` whose
poster turns queued items into pyverbs chains (``domain.py``) or, in the unit tests,
records them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from transferd.parts import ReadPart, Transfer, WritePart
from transferd.protocol.errors import PeerUnreachable, TransferdError
from transferd.rdma.constants import WrOpcode
from transferd.rdma.wrplan import LkeyOf, Sge, WrSpec, plan_part

from .counting import CarrierGate
from .reads import READ_MAX, ReadWindow, plan_read
from .sendq import SendQueue


class Link(Protocol):
    queue: SendQueue[Posted]
    max_msg: int
    max_sge: int


class ReadLink(Link, Protocol):
    reads: ReadWindow


@dataclass(slots=True, eq=False)
class PartState:
    transfer: Transfer
    left: int
    failed: bool = False

    def one_done(self, error: TransferdError | None) -> None:
        if self.failed:
            return
        if error is not None:
            self.failed = True
            self.transfer.part_done(error)
            return
        self.left -= 1
        if self.left == 0:
            self.transfer.part_done()


@dataclass(slots=True, eq=False)
class Posted:
    """One work request on its way: what it is, its part, its unit, its link."""

    spec: WrSpec
    part: PartState | None  # None for a SEND (its ``payload`` is told instead)
    link: Any
    unit: Hashable = None
    carrier: bool = False
    payload: Callable[[TransferdError | None], None] | None = None
    # A READ: the reader's views it writes into, held until its completion (or flush)
    # arrived; and the window it took a slot of.
    held: Sequence[memoryview] | None = None
    window: ReadWindow | None = None


class Sender:
    def __init__(self, lkey_of: Callable[[Any], LkeyOf], zero_sge: Callable[[Any], Sge]) -> None:
        """``lkey_of(link)`` and ``zero_sge(link)`` give the NIC's lkeys for a link."""
        self.gate: CarrierGate[Posted] = CarrierGate(self._release, self._drop)
        self._lkey_of = lkey_of
        self._zero_sge = zero_sge
        self._units = itertools.count(1)

    def write(self, link: Link, part: WritePart, transfer: Transfer) -> None:
        if transfer.finished:
            return
        wrs = plan_part(part, self._lkey_of(link), max_msg=link.max_msg,
                        max_sge=link.max_sge, zero_sge=self._zero_sge(link),
                        unit_key=lambda i: ("unit", next(self._units)))
        state = PartState(transfer, wrs.count)
        if state.left == 0:
            transfer.part_done()
            return
        for unit in wrs.units:
            carrier = None
            if unit.carrier is not None:
                carrier = Posted(unit.carrier, state, link, unit.key, True)
            self.gate.add(unit.key, unit.parts, len(unit.plain), carrier)
        link.queue.submit([Posted(s, state, link, s.unit) for s in wrs.plain])

    def read(self, link: ReadLink, part: ReadPart, transfer: Transfer) -> None:
        """``part`` as RDMA READs on ``link`` (the peer's write queue pair serves them),
        through its read window; BadRequest for a part no work request can carry."""
        if transfer.finished:
            return
        wrs = plan_read(part, self._lkey_of(link), max_msg=min(link.max_msg, READ_MAX),
                        max_sge=link.max_sge)
        state = PartState(transfer, len(wrs))
        if not wrs:
            transfer.part_done()
            return
        window = link.reads
        for w in wrs:
            posted = Posted(WrSpec(WrOpcode.RDMA_READ, w.sges, w.remote_addr, w.rkey),
                            state, link, held=part.into, window=window)
            try:
                window.offer(posted)
            except TransferdError as exc:  # the window's waiting room is full
                # Without its traceback: the transfer keeps its error, and this frame
                # holds the part's views.
                self.not_posted(posted, exc.with_traceback(None))
                return

    def send(self, link: Link, sge: Sge, on_done: Callable[[TransferdError | None], None]
             ) -> None:
        """A two-sided SEND of a frame already copied into the registered ``sge``;
        ``on_done`` when its work request completed (the slot may then be reused)."""
        link.queue.submit([Posted(WrSpec(WrOpcode.SEND, [sge]), None, link, None, False,
                                  on_done)])

    # -- completions -------------------------------------------------------------------

    def completed(self, posted: Posted, error: TransferdError | None) -> None:
        """A work request we posted completed (called by the completion dispatcher)."""
        posted.link.queue.completed(1)
        # A READ: the NIC is done with the reader's memory for it (read or flushed).
        posted.held = None
        if posted.unit is not None and not posted.carrier:
            self.gate.done(posted.unit, error)
        if posted.part is not None:
            posted.part.one_done(error)
        elif posted.payload is not None:
            posted.payload(error)
        if posted.window is not None:
            # After the part heard of it: a failed part's waiting READs are not posted.
            posted.window.done()

    def not_posted(self, posted: Posted, error: TransferdError) -> None:
        """A READ that never reached the send queue (refused, or still waiting in the
        window when its queue pair closed): its part fails; the NIC never saw it."""
        posted.held = None
        assert posted.part is not None
        posted.part.one_done(error)

    def post_read(self, posted: Posted) -> None:
        """The read window's poster: a READ given a slot goes onto the send queue, unless
        its transfer ended while it waited (nothing more lands in memory its owner has
        back)."""
        assert posted.part is not None and posted.window is not None
        if posted.part.failed or posted.part.transfer.finished:
            posted.held = None
            posted.window.done()
            return
        try:
            posted.link.queue.submit([posted])
        except TransferdError as exc:
            posted.window.done()  # its slot back: the next waiting READ goes
            self.not_posted(posted, exc.with_traceback(None))

    def _release(self, carrier: Posted) -> None:
        assert carrier.part is not None
        try:
            carrier.link.queue.submit([carrier])
        except TransferdError as exc:
            carrier.part.one_done(exc)

    def _drop(self, carrier: Posted, error: TransferdError) -> None:
        assert carrier.part is not None
        carrier.part.one_done(error)

    def close(self) -> None:
        self.gate.fail_all(PeerUnreachable("verbs domain closed"))
