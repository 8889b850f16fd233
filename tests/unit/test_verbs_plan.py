"""From engine write parts to verbs work requests: ranges, max message, SGE limits,
lkeys, and which work request carries the immediate."""

from __future__ import annotations

import numpy as np
import pytest

from transferd.engine.plan import WritePart, plan_paged, plan_single
from transferd.protocol.errors import BadRequest, NotFound
from transferd.protocol.values import MrDesc, NetAddr, Pages
from transferd.rdma.constants import WrOpcode
from transferd.rdma.mrtable import MrTable, Registration, address_of
from transferd.rdma.wrplan import plan_part

PTR = 0x7F00_0000_0000


def desc(rails: int) -> MrDesc:
    return MrDesc(PTR, [(NetAddr(1, 0, (("198.18.0.2", 7000 + r),)), 100 + r)
                        for r in range(rails)], 1 << 24)


@pytest.fixture
def mem() -> tuple[np.ndarray, MrTable]:
    a = np.zeros(1 << 20, np.uint8)
    t = MrTable()
    t.add(Registration(address_of(memoryview(a)), a.nbytes, 0x42, 0x99))
    return a, t


def plan(part: WritePart, t: MrTable, max_msg: int = 1 << 30, max_sge: int = 4):  # type: ignore[no-untyped-def]
    keys = iter(range(1000))
    return plan_part(part, lambda a, n: t.find(a, n).lkey, max_msg=max_msg,
                     max_sge=max_sge, zero_sge=(0x1000, 0, 7), unit_key=lambda i: next(keys))


def test_single_write_one_wr_carries_imm(mem) -> None:  # type: ignore[no-untyped-def]
    a, t = mem
    (part,) = plan_single(1, 8192, 5, memoryview(a)[100:8292], desc(1), 64, 1)
    wrs = plan(part, t)
    assert wrs.plain == [] and len(wrs.units) == 1
    c = wrs.units[0].carrier
    assert c is not None and c.opcode == WrOpcode.RDMA_WRITE_WITH_IMM and c.imm == 5
    assert c.sges == [(address_of(memoryview(a)) + 100, 8192, 0x42)]
    assert (c.remote_addr, c.rkey) == (PTR + 64, 100)


def test_max_msg_cuts_a_range_into_wrs_last_one_carries(mem) -> None:  # type: ignore[no-untyped-def]
    a, t = mem
    (part,) = plan_single(1, 10000, 5, memoryview(a)[:10000], desc(1), 0, 1)
    wrs = plan(part, t, max_msg=4096)
    assert [s.nbytes for s in wrs.plain] == [4096, 4096]
    assert [s.remote_addr - PTR for s in wrs.plain] == [0, 4096]
    assert wrs.units[0].carrier is not None and wrs.units[0].carrier.nbytes == 1808
    assert wrs.units[0].carrier.remote_addr == PTR + 8192
    assert all(s.opcode == WrOpcode.RDMA_WRITE for s in wrs.plain)
    assert wrs.count == 3


def test_split_write_only_the_last_part_holds_the_carrier(mem) -> None:  # type: ignore[no-untyped-def]
    a, t = mem
    parts = plan_single(3, 3 * 4096, 9, memoryview(a)[: 3 * 4096], desc(3), 0, 3,
                        split_min=4096)
    plans = [plan(p, t) for p in parts]
    assert [len(p.units) for p in plans] == [1, 1, 1]
    assert {p.units[0].key for p in plans} == {("op", 3)}  # one unit over every rail
    assert [p.units[0].carrier is not None for p in plans] == [False, False, True]
    assert all(u.parts == 3 for p in plans for u in p.units)


def test_paged_write_each_page_its_own_unit_and_sges_gather(mem) -> None:  # type: ignore[no-untyped-def]
    a, t = mem
    views = [memoryview(a)[i * 4096:(i + 1) * 4096] for i in range(5)]
    (part,) = plan_paged(2, 4096, 1, views, desc(1), Pages([4, 3, 2, 1, 0], 4096), 1)
    wrs = plan(part, t)
    assert len(wrs.units) == 5 and wrs.plain == []
    assert [u.carrier.remote_addr - PTR for u in wrs.units if u.carrier] == [
        16384, 12288, 8192, 4096, 0]
    assert len({u.key for u in wrs.units}) == 5


def test_sge_limit_cuts_wrs(mem) -> None:  # type: ignore[no-untyped-def]
    a, t = mem
    # One destination range from 6 source pieces: 4 SGEs at most per WR.
    src = [memoryview(a)[i * 8192 : i * 8192 + 100] for i in range(6)]
    part = WritePart(0, desc(1).rkeys[0][0], 100, [PTR], [600], src, None)
    wrs = plan(part, t, max_sge=4)
    assert [len(s.sges) for s in wrs.plain] == [4, 2]
    assert [s.remote_addr - PTR for s in wrs.plain] == [0, 400]


def test_unregistered_source_is_refused(mem) -> None:  # type: ignore[no-untyped-def]
    _, t = mem
    other = np.zeros(4096, np.uint8)
    (part,) = plan_single(1, 4096, None, memoryview(other), desc(1), 0, 1)
    with pytest.raises(NotFound, match="not inside memory registered"):
        plan(part, t)


def test_inconsistent_parts_are_refused(mem) -> None:  # type: ignore[no-untyped-def]
    a, t = mem
    v = memoryview(a)[:100]
    addr = desc(1).rkeys[0][0]
    with pytest.raises(BadRequest, match="one range per part"):
        plan(WritePart(0, addr, 1, [PTR, PTR + 100], [50, 50], [v], 5, [PTR, 200], parts=2), t)
    with pytest.raises(BadRequest, match="fewer source bytes"):
        plan(WritePart(0, addr, 1, [PTR], [200], [v], None), t)
    with pytest.raises(BadRequest, match="more source bytes"):
        plan(WritePart(0, addr, 1, [PTR], [50], [v], None), t)
    with pytest.raises(BadRequest, match="destination descriptor"):
        plan(WritePart(0, addr, 1, [], [], [], 5), t)


def test_mrtable_refuses_overlap_and_finds_by_range() -> None:
    t = MrTable()
    t.add(Registration(1000, 100, 1, 1))
    t.add(Registration(2000, 100, 2, 2))
    with pytest.raises(BadRequest, match="overlaps"):
        t.add(Registration(1050, 100, 3, 3))
    assert t.find(2000, 100).lkey == 2
    with pytest.raises(NotFound):
        t.find(1050, 100)  # runs past the end
    assert t.remove(t.find(1000, 1)).lkey == 1
    with pytest.raises(NotFound):
        t.find(1000, 1)


def test_rkeys_and_addresses_that_do_not_fit_a_work_request_are_refused(mem) -> None:  # type: ignore[no-untyped-def]
    a, t = mem
    v = memoryview(a)[:100]
    addr = desc(1).rkeys[0][0]
    with pytest.raises(BadRequest, match="not a verbs rkey"):
        plan(WritePart(0, addr, 1 << 40, [PTR], [100], [v], None), t)
    with pytest.raises(BadRequest, match="64-bit"):
        plan(WritePart(0, addr, 1, [(1 << 64) - 50], [100], [v], None), t)
