"""Counting on verbs: a write counts exactly once at the receiver, and never before all
of its bytes are in place, whatever order the completions come in.

The initiator's pure pipeline (engine plan -> verbs work requests -> carrier gate ->
send queues -> completion dispatch) runs as in the Domain; the fabric between the two
sides is a recorded list of completions, delivered in every order (all interleavings by
exhaustive search, and itertools.permutations over the static ones).  A plain WRITE's
bytes count as placed when its initiator's completion arrives (RC: the responder
acknowledged them), the carrier's when the receiver's RECV_RDMA_WITH_IMM arrives.  The
receiver side is the real Dispatcher feeding the real ImmCounter.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from transferd.domains.verbs.sender import Posted, Sender
from transferd.domains.verbs.sendq import SendQueue
from transferd.engine.immcounter import ImmCounter
from transferd.engine.plan import WritePart, plan_barrier, plan_paged, plan_single
from transferd.engine.transfer import Transfer
from transferd.protocol.errors import PeerUnreachable, TransferdError
from transferd.protocol.values import MrDesc, NetAddr, Pages
from transferd.rdma.completions import (
    Completion,
    Dispatcher,
    QpRole,
    WrIds,
    WrKind,
    wr_id,
)
from transferd.rdma.constants import WcOpcode, WcStatus, WrOpcode
from transferd.rdma.mrtable import MrTable, Registration, address_of

PTR = 0x7F00_0000_0000
RKEY = 0x1234
WRITE_QPN = 77
IMM = 0xC0FFEE


def _desc(rails: int, ptr: int = PTR, node: int = 9) -> MrDesc:
    return MrDesc(ptr, [(NetAddr(node, 0, (("198.18.0.2", 7000 + r),)), RKEY + r)
                        for r in range(rails)], 1 << 20)


@dataclass(eq=False)
class RecLink:
    """One write queue pair's send side, recording what it posts."""

    rail: int
    harness: Harness
    max_msg: int = 4096
    max_sge: int = 4
    queue: SendQueue[Posted] = field(init=False)

    def __post_init__(self) -> None:
        self.queue = SendQueue(64, self.harness.posted)


class Harness:
    """Initiator pipeline + recorded fabric + receiver (Dispatcher and ImmCounter)."""

    def __init__(self, rails: int, fail_at: int | None = None) -> None:
        self.src = np.arange(1 << 16, dtype=np.uint8) % 251
        self.mrs = MrTable()
        self.mrs.add(Registration(address_of(memoryview(self.src)), self.src.nbytes, 0x55, 0))
        sink = np.zeros(64, np.uint8)
        self.sink = sink
        self.sender = Sender(lambda link: lambda a, n: self.mrs.find(a, n).lkey,
                             lambda link: (address_of(memoryview(sink)), 0, 0x56))
        self.links = [RecLink(r, self) for r in range(rails)]
        self.pending: list[tuple[str, Posted]] = []  # the fabric: events not yet delivered
        self.landed: dict[object, int] = {}  # bytes placed per unit
        self.unit_size: dict[object, int] = {}  # bytes per unit, from the plan
        self.counter = ImmCounter()
        self.counts: list[object] = []
        self.results: list[TransferdError | None] = []
        self.reposted: list[int] = []
        self.fail_at = fail_at
        self.delivered = 0
        self.recv = Dispatcher[object](
            WrIds(1), on_send_done=lambda *_: None, on_imm=self._on_imm,
            on_message=lambda *_: None, repost=lambda qpn, slot: self.reposted.append(slot),
            on_broken=lambda peer, why: pytest.fail(why))
        self.recv.qps[WRITE_QPN] = QpRole(peer=(9, 0), write=True)
        self._current: Posted | None = None

    # the send queues' poster: a posted WR becomes its initiator completion, and for a
    # carrier also the receiver's completion
    def posted(self, batch: list[Posted]) -> None:
        for p in batch:
            self.unit_size[p.unit] = self.unit_size.get(p.unit, 0) + p.spec.nbytes
            self.pending.append(("send", p))
            if p.spec.opcode == WrOpcode.RDMA_WRITE_WITH_IMM:
                assert p.carrier and p.spec.imm == IMM
                self.pending.append(("recv", p))

    def transfer(self, nparts: int) -> Transfer:
        return Transfer(1, nparts, 0, self.results.append)

    def submit(self, parts: list[WritePart]) -> None:
        t = self.transfer(len(parts))
        for part in parts:
            self.sender.write(self.links[part.rail], part, t)

    def deliver(self, i: int) -> None:
        kind, p = self.pending.pop(i)
        if kind == "send":
            err = None
            if self.fail_at is not None and self.delivered == self.fail_at and not p.carrier:
                err = PeerUnreachable("RETRY_EXC_ERR")
            self.delivered += 1
            if not p.carrier and err is None:
                self.landed[p.unit] = self.landed.get(p.unit, 0) + p.spec.nbytes
            self.sender.completed(p, err)
        else:
            self.landed[p.unit] = self.landed.get(p.unit, 0) + p.spec.nbytes
            self._current = p
            self.recv.dispatch(Completion(
                wr_id(WrKind.WRITE_RECV, 3), WcStatus.SUCCESS, WcOpcode.RECV_RDMA_WITH_IMM,
                WRITE_QPN, p.spec.nbytes, socket.htonl(p.spec.imm or 0)))

    def _on_imm(self, peer: object, imm: int, nbytes: int) -> None:
        p = self._current
        assert p is not None and imm == IMM
        # Never early: every byte of the unit is in place when its count moves.  A unit's
        # work requests are all posted before its carrier's count can come.
        assert self.landed.get(p.unit, 0) == self.expected_unit(p), (p.unit, self.landed)
        self.counts.append(p.unit)
        self.counter.add(imm, 1)

    expected_unit: Callable[[Posted], int]


def explore(make: Callable[[], Harness], check: Callable[[Harness], None],
            limit: int = 200_000) -> int:
    """Deliver the fabric's events in every order; ``check`` each finished run."""
    leaves = 0
    stack: list[list[int]] = [[]]
    while stack:
        prefix = stack.pop()
        h = make()
        for i in prefix:
            h.deliver(i)
        if not h.pending:
            check(h)
            leaves += 1
            assert leaves < limit
            continue
        stack.extend([*prefix, i] for i in range(len(h.pending)))
    return leaves


def _split_write(h: Harness, length: int, rails: int) -> None:
    src = memoryview(h.src)[:length]
    parts = plan_single(5, length, IMM, src, _desc(rails), 0, rails, split_min=4096)
    assert len(parts) == rails and all(p.parts == rails for p in parts)
    h.expected_unit = lambda p: length
    h.submit(list(parts))


@pytest.mark.parametrize(("rails", "length"), [(2, 3 * 4096), (3, 6 * 4096), (3, 3 * 4096)])
def test_split_single_write_counts_once_in_every_order(rails: int, length: int) -> None:
    def make() -> Harness:
        h = Harness(rails)
        _split_write(h, length, rails)
        return h

    def check(h: Harness) -> None:
        assert h.counter.value(IMM) == 1 and len(h.counts) == 1
        assert h.results == [None]
        assert len(h.sender.gate) == 0 and h.reposted == [3]

    leaves = explore(make, check)
    assert leaves > 2  # the orders really vary


def test_split_write_plain_completions_in_all_permutations() -> None:
    """The same with itertools.permutations: a write of 5 pages of max_msg over 2 rails
    is 5 WRs, 4 plain; each of the 24 orders of those, then the carrier's two."""
    seen = 0
    h0 = Harness(2)
    _split_write(h0, 5 * 4096, 2)
    plain = [p for k, p in h0.pending if k == "send"]
    assert len(plain) == 4 and not any(p.carrier for p in plain)
    for order in itertools.permutations(range(4)):
        for carrier_first in (True, False):
            h = Harness(2)
            _split_write(h, 5 * 4096, 2)
            posted = [p for _, p in h.pending]
            for j in order:
                i = next(k for k, (_, p) in enumerate(h.pending) if p is posted[j])
                h.deliver(i)
                if j != order[-1]:
                    assert h.counter.value(IMM) == 0  # not before every part is done
            kinds = [k for k, _ in h.pending]
            assert sorted(kinds) == ["recv", "send"]  # only now is the carrier posted
            h.deliver(kinds.index("recv" if carrier_first else "send"))
            h.deliver(0)
            assert h.counter.value(IMM) == 1 and h.results == [None]
            seen += 1
    assert seen == 48


def test_paged_write_counts_one_per_page_in_every_order() -> None:
    page = 8192  # two WRs per page at max_msg 4096: one plain, one carrier

    def make() -> Harness:
        h = Harness(2)
        views = [memoryview(h.src)[i * page:(i + 1) * page] for i in range(2)]
        parts = plan_paged(6, page, IMM, views, _desc(2), Pages([3, 0], page), 2)
        h.expected_unit = lambda p: page
        h.submit(list(parts))
        return h

    def check(h: Harness) -> None:
        assert h.counter.value(IMM) == 2 and len(set(h.counts)) == 2
        assert h.results == [None]

    assert explore(make, check) > 2


def test_barrier_zero_length_writes_carry_a_valid_descriptor() -> None:
    def make() -> Harness:
        h = Harness(2)
        descs = [_desc(2, PTR + (n << 24), node=n) for n in (1, 2, 3)]
        parts = plan_barrier(7, IMM, descs, 2)
        h.expected_unit = lambda p: 0
        h.submit(list(parts))
        for (_, p), d in zip([e for e in h.pending if e[0] == "send"], descs, strict=True):
            # A registered local address with length 0, the region's address and rkey.
            assert p.spec.sges == [(address_of(memoryview(h.sink)), 0, 0x56)]
            assert p.spec.remote_addr == d.ptr and p.spec.rkey == d.rkeys[p.link.rail][1]
        return h

    def check(h: Harness) -> None:
        assert h.counter.value(IMM) == 3 and h.results == [None]

    assert explore(make, check) > 2


@pytest.mark.parametrize("fail_at", range(4))
def test_a_failed_part_never_counts_and_fails_the_transfer(fail_at: int) -> None:
    for order in itertools.permutations(range(4)):
        h = Harness(2, fail_at=fail_at)
        _split_write(h, 5 * 4096, 2)
        posted = [p for _, p in h.pending]
        for j in order:
            i = next(k for k, (_, p) in enumerate(h.pending) if p is posted[j])
            h.deliver(i)
        # The carrier was never posted: nothing is pending, nothing counted.
        assert h.pending == [] and h.counter.value(IMM) == 0 and h.counts == []
        assert len(h.results) == 1 and isinstance(h.results[0], PeerUnreachable)
        assert len(h.sender.gate) == 0


def test_a_write_without_immediate_posts_only_plain_writes() -> None:
    h = Harness(2)
    src = memoryview(h.src)[: 3 * 4096]
    h.submit(list(plan_single(8, 3 * 4096, None, src, _desc(2), 0, 2, split_min=4096)))
    assert {p.spec.opcode for _, p in h.pending} == {WrOpcode.RDMA_WRITE}
    while h.pending:
        h.deliver(0)
    assert h.results == [None] and h.counter.value(IMM) == 0
