"""Work requests built as real pyverbs objects (SendWR, SGE, RecvWR, chains of four).

Needs pyverbs (``make rdma-deps``), no device: pyverbs builds these structures in
user memory.  Skipped, with the reason, where pyverbs does not import.
"""

from __future__ import annotations

import socket

import pytest

from transferd.rdma.loader import pyverbs_missing

MISSING = pyverbs_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

if MISSING is None:
    import pyverbs.enums as e
    from pyverbs.wr import SendWR

    from transferd.rdma import wr as vwr

from transferd.rdma.completions import WrKind, split_wr_id, wr_id  # noqa: E402
from transferd.rdma.constants import (  # noqa: E402
    CHAIN_MAX,
    IBV_SEND_SIGNALED,
    IBV_WC_WITH_IMM,
    WcOpcode,
    WcStatus,
    WrOpcode,
)
from transferd.rdma.wrplan import WrSpec  # noqa: E402

SINK = (0x5000, 64, 0x77)


def test_constants_match_pyverbs() -> None:
    assert WrOpcode.RDMA_WRITE == e.IBV_WR_RDMA_WRITE
    assert WrOpcode.RDMA_WRITE_WITH_IMM == e.IBV_WR_RDMA_WRITE_WITH_IMM
    assert WrOpcode.SEND == e.IBV_WR_SEND
    assert WrOpcode.SEND_WITH_IMM == e.IBV_WR_SEND_WITH_IMM
    assert WrOpcode.RDMA_READ == e.IBV_WR_RDMA_READ and WcOpcode.RDMA_READ == e.IBV_WC_RDMA_READ
    assert WcOpcode.SEND == e.IBV_WC_SEND and WcOpcode.RDMA_WRITE == e.IBV_WC_RDMA_WRITE
    assert WcOpcode.RECV == e.IBV_WC_RECV
    assert WcOpcode.RECV_RDMA_WITH_IMM == e.IBV_WC_RECV_RDMA_WITH_IMM
    for s in WcStatus:
        assert s == getattr(e, f"IBV_WC_{s.name}")
    assert IBV_SEND_SIGNALED == e.IBV_SEND_SIGNALED and IBV_WC_WITH_IMM == e.IBV_WC_WITH_IMM


def test_write_with_imm_fields() -> None:
    spec = WrSpec(WrOpcode.RDMA_WRITE_WITH_IMM, [(0x1000, 4096, 0x42), (0x9000, 100, 0x43)],
                  0x7F00_0000_0000, 0x1234, imm=0x01020304)
    w = vwr.build_send_wr(spec, wr_id(WrKind.SEND, 9))
    try:
        assert w.opcode == e.IBV_WR_RDMA_WRITE_WITH_IMM and w.num_sge == 2
        assert w.imm_data == socket.htonl(0x01020304)  # the wire wants network order
        assert w.send_flags == e.IBV_SEND_SIGNALED
        assert split_wr_id(w.wr_id) == (WrKind.SEND, 9)
        assert w.next_wr is None
    finally:
        w.close()


def test_plain_write_has_no_immediate() -> None:
    w = vwr.build_send_wr(WrSpec(WrOpcode.RDMA_WRITE, [(0x1000, 8, 1)], 0x2000, 5), 1)
    try:
        assert w.opcode == e.IBV_WR_RDMA_WRITE and w.imm_data == 0
    finally:
        w.close()


def test_rdma_read_names_the_remote_range_and_scatters_locally() -> None:
    spec = WrSpec(WrOpcode.RDMA_READ, [(0x1000, 4096, 0x42), (0x9000, 100, 0x43)],
                  0x7F00_0000_2000, 0x1234)
    w = vwr.build_send_wr(spec, wr_id(WrKind.SEND, 4))
    try:
        assert w.opcode == e.IBV_WR_RDMA_READ and w.num_sge == 2 and w.imm_data == 0
        assert w.send_flags == e.IBV_SEND_SIGNALED
    finally:
        w.close()
    # The remote address and rkey are what set_wr_rdma stored (pyverbs 44 has no
    # getter for them): a READ built without it would read address 0 with rkey 0.
    calls: list[tuple[int, int]] = []

    class Spy(SendWR):
        def set_wr_rdma(self, rkey: int, addr: int) -> None:
            calls.append((rkey, addr))
            super().set_wr_rdma(rkey, addr)

    real = vwr.SendWR
    vwr.SendWR = Spy  # type: ignore[misc]
    try:
        vwr.build_send_wr(spec, 1).close()
    finally:
        vwr.SendWR = real  # type: ignore[misc]
    assert calls == [(0x1234, 0x7F00_0000_2000)]


def test_rdma_channel_messages_carry_their_credits_as_the_immediate() -> None:
    # A credit return: zero bytes, one valid SGE (pyverbs refuses a SendWR without one).
    w = vwr.build_send_wr(WrSpec(WrOpcode.SEND_WITH_IMM, [(0x1000, 0, 7)], imm=17), 3)
    try:
        assert w.opcode == e.IBV_WR_SEND_WITH_IMM and w.num_sge == 1
        assert w.imm_data == socket.htonl(17) and w.send_flags == e.IBV_SEND_SIGNALED
    finally:
        w.close()


def test_chains_of_at_most_four() -> None:
    items = [(WrSpec(WrOpcode.RDMA_WRITE, [(0x1000 + i, 1, 1)], 0x2000 + i, 5), i)
             for i in range(10)]
    chains = vwr.build_chains(items)
    try:
        assert [len(c.wrs) for c in chains] == [4, 4, 2]
        assert [w.wr_id for c in chains for w in c.wrs] == list(range(10))
        assert all(isinstance(w, SendWR) for c in chains for w in c.wrs)
        assert all(c.wrs[-1].next_wr is None for c in chains)  # each chain ends
        assert len(chains[0].owned) == 4
    finally:
        for c in chains:
            c.close()
    assert CHAIN_MAX == 4


def test_zero_length_template_is_a_chain_tail_used_once_per_batch() -> None:
    t = vwr.ZeroWriteTemplate(SINK)
    zero = [WrSpec(WrOpcode.RDMA_WRITE_WITH_IMM, [(SINK[0], 0, SINK[2])], 0x7000 + i, 9,
                   imm=3) for i in range(2)]
    plain = WrSpec(WrOpcode.RDMA_WRITE, [(0x1000, 8, 1)], 0x2000, 5)
    chains = vwr.build_chains([(plain, 1), (zero[0], 2), (zero[1], 3)], t)
    try:
        assert [len(c.wrs) for c in chains] == [2, 1]
        assert chains[0].wrs[1] is t.wr  # the tail of its chain, and filled
        assert t.wr.wr_id == 2 and t.wr.imm_data == socket.htonl(3)
        assert t.wr.opcode == e.IBV_WR_RDMA_WRITE_WITH_IMM and t.wr.num_sge == 1
        assert chains[0].owned == [chains[0].wrs[0]]  # the template is not closed
        assert chains[1].wrs[0] is not t.wr and chains[1].wrs[0].wr_id == 3
    finally:
        for c in chains:
            c.close()
        t.close()


def test_recv_slots_built_once() -> None:
    slots = vwr.RecvSlots(int(WrKind.RECV), 0x10000, 4096, 8, 0x42)
    try:
        assert len(slots) == 8
        assert [split_wr_id(w.wr_id) for w in slots.wrs] == [(WrKind.RECV, i) for i in range(8)]
        assert all(w.num_sge == 1 for w in slots.wrs)
        assert slots.offset(3) == 3 * 4096
        sink = vwr.RecvSlots(int(WrKind.WRITE_RECV), SINK[0], SINK[1], 4, SINK[2], stride=0)
        assert sink.offset(3) == 0  # every write receive names the same sink
        sink.close()
    finally:
        slots.close()


def test_rtr_rts_attributes_from_the_exchange() -> None:
    """The QPAttr that connects our RC queue pair to the peer's, as real pyverbs."""
    from transferd.rdma.exchange import QpInfo
    from transferd.rdma.resources import rtr_rts_attr

    gid = bytes.fromhex("00000000000000000000ffffc6120002")  # ::ffff:198.18.0.2
    mine = QpInfo(0x100, 0x111, 0, 1, gid, 3, 5)
    theirs = QpInfo(0x200, 0x222, 0, 1, gid, 1, 3)
    a = rtr_rts_attr(1, mine, theirs)
    assert a.dest_qp_num == 0x200 and a.rq_psn == 0x222 and a.sq_psn == 0x111
    assert a.path_mtu == 3  # the smaller of the two ports' MTUs
    assert a.qp_access_flags == e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    assert (a.max_rd_atomic, a.max_dest_rd_atomic) == (1, 1)
    # A write queue pair posts and serves READs: remote read access, the device's depths.
    r = rtr_rts_attr(1, mine, theirs, reads=(16, 8))
    assert r.qp_access_flags == (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
                                 | e.IBV_ACCESS_REMOTE_READ)
    assert (r.max_rd_atomic, r.max_dest_rd_atomic) == (16, 8)
    assert a.rnr_retry == 7 and a.retry_cnt == 7 and a.timeout == 14
    ah = a.ah_attr
    assert ah.is_global == 1 and ah.dgid == theirs.gid_text and ah.sgid_index == 3
    ib = rtr_rts_attr(1, mine, QpInfo(0x200, 1, 0x17, 1, b"\0" * 16, 0, 4))
    assert ib.ah_attr.is_global == 0 and ib.ah_attr.dlid == 0x17


def test_remote_read_is_granted_when_the_queue_pair_is_made() -> None:
    """pyverbs applies qp_access_flags only on the way to INIT (to_rtr/to_rts masks have
    no IBV_QP_ACCESS_FLAGS): a write queue pair must be made with REMOTE_READ."""
    from transferd.rdma.resources import init_attr

    rw = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    assert init_attr(1, reads=False).qp_access_flags == rw
    assert init_attr(1, reads=True).qp_access_flags == rw | e.IBV_ACCESS_REMOTE_READ
