"""Completion dispatch (recorded completions, every order), receive reposting, wr_id
tables and send-queue doorbell batches."""

from __future__ import annotations

import itertools
import socket

import pytest

from transferd.domains.verbs.sendq import SendQueue
from transferd.engine.immcounter import ImmCounter
from transferd.protocol.errors import BadRequest, NotFound, PeerUnreachable, TransferdError
from transferd.rdma.completions import (
    Completion,
    Dispatcher,
    QpRole,
    WrIds,
    WrKind,
    split_wr_id,
    wr_id,
)
from transferd.rdma.constants import CHAIN_MAX, WcOpcode, WcStatus

SEND_QPN, WRITE_QPN = 10, 11
PEER = (7, 0)


class Rx:
    def __init__(self) -> None:
        self.counter = ImmCounter()
        self.sends: list[tuple[str, TransferdError | None]] = []
        self.messages: list[tuple[object, int, int, int]] = []
        self.reposted: list[tuple[int, int]] = []
        self.broken: list[str] = []
        self.ids: WrIds[str] = WrIds(8)
        self.d: Dispatcher[str] = Dispatcher(
            self.ids, on_send_done=lambda item, err: self.sends.append((item, err)),
            on_imm=lambda peer, imm, n: self.counter.add(imm, 1),
            on_message=lambda *a: self.messages.append(a),
            repost=lambda qpn, slot: self.reposted.append((qpn, slot)),
            on_broken=lambda peer, why: self.broken.append(why))
        self.d.qps[SEND_QPN] = QpRole(PEER, write=False)
        self.d.qps[WRITE_QPN] = QpRole(PEER, write=True)


def imm_wc(slot: int, imm: int, n: int = 0) -> Completion:
    return Completion(wr_id(WrKind.WRITE_RECV, slot), WcStatus.SUCCESS,
                      WcOpcode.RECV_RDMA_WITH_IMM, WRITE_QPN, n, socket.htonl(imm))


def test_wr_id_round_trip() -> None:
    for kind in WrKind:
        assert split_wr_id(wr_id(kind, 12345)) == (kind, 12345)
    assert split_wr_id(99 << 56) == (None, 0)
    with pytest.raises(ValueError):
        wr_id(WrKind.SEND, 1 << 56)


def test_write_with_imm_completions_count_in_every_order_and_repost_each_slot() -> None:
    wcs = [imm_wc(0, 5), imm_wc(1, 5), imm_wc(2, 6), imm_wc(3, 5)]
    for order in itertools.permutations(wcs):
        rx = Rx()
        fired: list[int] = []
        rx.counter.expect(5, 3, lambda fired=fired: fired.append(5))
        for i, wc in enumerate(order):
            rx.d.dispatch(wc)
            # The expectation fires exactly when the third 5 arrives, never before.
            assert fired == ([5] if sum(w.imm == 5 for w in order[: i + 1]) >= 3 else [])
        assert rx.counter.value(6) == 1 and rx.counter.value(5) == 0
        assert sorted(rx.reposted) == [(WRITE_QPN, s) for s in range(4)]
        assert rx.broken == []


def test_imm_is_read_in_network_order() -> None:
    rx = Rx()
    rx.d.dispatch(imm_wc(0, 0x01020304))
    assert rx.counter.value(0x01020304) == 1 and rx.counter.value(0x04030201) == 0


def test_recv_hands_the_slot_over_and_leaves_reposting_to_the_taker() -> None:
    rx = Rx()
    rx.d.dispatch(Completion(wr_id(WrKind.RECV, 4), 0, WcOpcode.RECV, SEND_QPN, 77))
    assert rx.messages == [(PEER, SEND_QPN, 4, 77)] and rx.reposted == []


def test_send_completions_find_their_item_once() -> None:
    rx = Rx()
    a, b = rx.ids.put("a"), rx.ids.put("b")
    rx.d.dispatch(Completion(wr_id(WrKind.SEND, b), WcStatus.RETRY_EXC_ERR,
                             WcOpcode.RDMA_WRITE, WRITE_QPN))
    rx.d.dispatch(Completion(wr_id(WrKind.SEND, a), 0, WcOpcode.RDMA_WRITE, WRITE_QPN))
    rx.d.dispatch(Completion(wr_id(WrKind.SEND, a), 0, WcOpcode.RDMA_WRITE, WRITE_QPN))
    assert [s[0] for s in rx.sends] == ["b", "a"]
    assert isinstance(rx.sends[0][1], PeerUnreachable) and "RETRY_EXC_ERR" in str(
        rx.sends[0][1])
    assert rx.sends[1][1] is None and rx.d.unknown == 1 and len(rx.ids) == 0


def test_a_refused_access_is_not_found_and_anything_else_unreachable() -> None:
    """REM_ACCESS_ERR (a READ of a write-only region, a revoked rkey) is the peer's answer:
    NOT_FOUND, which failover does not retry; a flush or exhausted retries are not."""
    rx = Rx()
    for status in (WcStatus.REM_ACCESS_ERR, WcStatus.WR_FLUSH_ERR, WcStatus.RETRY_EXC_ERR):
        rx.d.dispatch(Completion(wr_id(WrKind.SEND, rx.ids.put(status.name)), status,
                                 WcOpcode.RDMA_READ, WRITE_QPN))
    errors = [type(e) for _, e in rx.sends]
    assert errors == [NotFound, PeerUnreachable, PeerUnreachable]


def test_failed_and_misplaced_receives() -> None:
    rx = Rx()
    # Flushed receives (the queue pair closed) are quiet and never reposted.
    rx.d.dispatch(Completion(wr_id(WrKind.WRITE_RECV, 0), WcStatus.WR_FLUSH_ERR, 0,
                             WRITE_QPN))
    assert rx.broken == [] and rx.reposted == []
    rx.d.dispatch(Completion(wr_id(WrKind.RECV, 0), WcStatus.LOC_LEN_ERR, 0, SEND_QPN))
    # A plain SEND arriving on the write queue pair, an imm on the send one.
    rx.d.dispatch(Completion(wr_id(WrKind.WRITE_RECV, 1), 0, WcOpcode.RECV, WRITE_QPN))
    rx.d.dispatch(Completion(wr_id(WrKind.RECV, 1), 0, WcOpcode.RECV_RDMA_WITH_IMM,
                             SEND_QPN))
    rx.d.dispatch(Completion(wr_id(WrKind.WRITE_RECV, 2), 0, WcOpcode.RECV_RDMA_WITH_IMM,
                             SEND_QPN))
    assert len(rx.broken) == 4 and "LOC_LEN_ERR" in rx.broken[0]
    assert rx.reposted == [] and rx.counter.value(0) == 0
    rx.d.dispatch(Completion(wr_id(WrKind.WRITE_RECV, 0), 0, WcOpcode.RECV_RDMA_WITH_IMM,
                             999))  # a queue pair we do not know
    assert rx.d.unknown == 1


def test_wrids_is_bounded_and_reuses_indices() -> None:
    ids: WrIds[int] = WrIds(2)
    a, b = ids.put(1), ids.put(2)
    with pytest.raises(OverflowError):
        ids.put(3)
    assert ids.pop(a) == 1 and ids.pop(a) is None
    assert ids.put(4) == a and sorted(ids.drain()) == [2, 4] and len(ids) == 0
    assert b != a


def test_send_queue_respects_depth_and_batches_the_room() -> None:
    batches: list[list[int]] = []
    q: SendQueue[int] = SendQueue(6, batches.append, max_waiting=20)
    q.submit(list(range(10)))
    assert batches == [[0, 1, 2, 3, 4, 5]] and q.waiting == 4 and q.in_flight == 6
    q.completed(3)
    assert batches[-1] == [6, 7, 8] and q.in_flight == 6
    q.completed(6)
    assert batches[-1] == [9] and q.in_flight == 1 and q.waiting == 0
    with pytest.raises(BadRequest, match="send queue full"):
        q.submit(list(range(26)))
    assert CHAIN_MAX == 4
