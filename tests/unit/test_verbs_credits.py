"""rdma:// credit flow control without a device: two channel ends' Credits driven over
a stand-in RC connection that keeps a receive queue per end (a SEND that finds no
posted receive is an RNR: with rnr_retry = 7, the old channel's setting, retried
forever), with receivers that pause as a back-pressured protocol does.

The RC channel itself (pyverbs, a NIC) is tests/rdma/test_rdma_protocol.py's, over
``make rdma-check``."""

from __future__ import annotations

import random
import socket
from collections import deque
from dataclasses import dataclass, field

import pytest

from transferd.protocol.errors import BadFrame, BadRequest, Timeout
from transferd.rdma.completions import Completion, Dispatcher, QpRole, WrIds, WrKind, wr_id
from transferd.rdma.constants import IBV_WC_WITH_IMM, WcOpcode, WcStatus
from transferd.rdma.credits import Credits, FlowState
from transferd.rdma.exchange import ChannelSetup, QpInfo

DEPTH = 32


@dataclass
class Msg:
    imm: int
    body: int | None  # None: a credit return (zero bytes)


@dataclass
class End:
    name: str
    flow: Credits
    posted: int = DEPTH  # receives posted
    landed: deque[Msg] = field(default_factory=deque)  # in receives, not yet taken
    out: deque[int] = field(default_factory=deque)  # messages waiting to go
    got: list[int] = field(default_factory=list)
    paused: bool = False
    rnr: int = 0
    sent: int = 0


def pair(stall_s: float = 30.0) -> tuple[End, End]:
    return (End("a", Credits(DEPTH, DEPTH, stall_s=stall_s)),
            End("b", Credits(DEPTH, DEPTH, stall_s=stall_s)))


def wire(src: End, dst: End, msg: Msg) -> None:
    if dst.posted == 0:
        src.rnr += 1  # no receive: RNR NAK, retried (forever with rnr_retry = 7)
        return
    dst.posted -= 1
    dst.flow.returned(msg.imm)  # the dispatcher hands the immediate over at once
    if msg.body is None:
        dst.posted += 1  # a credit return is reposted at once, paused or not
        dst.flow.reposted()
    else:
        dst.landed.append(msg)


def step(me: End, peer: End) -> bool:
    """What the channel does on its loop; True when anything moved."""
    moved = False
    while me.landed and not me.paused:
        msg = me.landed.popleft()
        assert msg.body is not None
        me.got.append(msg.body)
        me.posted += 1
        me.flow.reposted()
        moved = True
    while me.out and me.flow.can_send():
        wire(me, peer, Msg(me.flow.send(), me.out.popleft()))
        me.sent += 1
        moved = True
    if me.flow.credit_due():
        wire(me, peer, Msg(me.flow.send_credits(), None))
        moved = True
    return moved


def run(a: End, b: End, limit: int = 100_000) -> None:
    for _ in range(limit):
        if not (step(a, b) | step(b, a)):
            return
    raise AssertionError("no quiescence")


def test_a_paused_receiver_stops_the_sender_at_its_receives_then_fails_it_typed() -> None:
    a, b = pair(stall_s=30.0)
    b.paused = True
    a.out.extend(range(200))
    run(a, b)
    # One credit stays for a credit return: 31 messages, each into a posted receive.
    assert a.sent == DEPTH - 1 and len(b.landed) == DEPTH - 1
    assert a.rnr == 0  # the old channel freed its slot at completion: RNR forever
    a.flow.waiting(now=100.0)
    assert a.flow.state is FlowState.STALLED
    assert a.flow.check(now=129.9) is None  # a bounded wait ...
    err = a.flow.check(now=130.0)
    assert isinstance(err, Timeout) and "stopped reading" in err.message  # ... then typed
    assert a.flow.state is FlowState.FAILED and not a.flow.can_send()


def test_a_receiver_that_resumes_in_time_gets_every_message_in_order() -> None:
    a, b = pair()
    b.paused = True
    a.out.extend(range(500))
    run(a, b)
    a.flow.waiting(now=0.0)
    b.paused = False
    run(a, b)
    assert b.got == list(range(500)) and a.rnr == 0
    assert a.flow.state is FlowState.OPEN and a.flow.check(now=1e9) is None
    # Credit returns ride on nothing here (b sends no data): about one per half depth.
    assert b.flow.credit_messages <= 500 // (DEPTH // 2) + 2


@pytest.mark.parametrize("seed", range(20))
def test_both_ways_with_pauses_nothing_meets_a_missing_receive_and_all_arrives(
        seed: int) -> None:
    rng = random.Random(seed)
    a, b = pair()
    n = 300
    todo = {a.name: deque(range(n)), b.name: deque(range(1000, 1000 + n))}
    for _ in range(5_000):
        for me in (a, b):
            if todo[me.name] and rng.random() < 0.5:
                me.out.extend(todo[me.name].popleft() for _ in range(
                    min(len(todo[me.name]), rng.randint(1, 40))))
            me.paused = rng.random() < 0.3
        step(a, b)
        step(b, a)
    a.paused = b.paused = False
    while todo[a.name] or todo[b.name]:
        a.out.extend(todo[a.name])
        b.out.extend(todo[b.name])
        todo[a.name].clear()
        todo[b.name].clear()
    run(a, b)
    assert b.got == list(range(n)) and a.got == list(range(1000, 1000 + n))
    assert a.rnr == b.rnr == 0
    assert 0 <= a.flow.credits <= DEPTH and 0 <= b.flow.credits <= DEPTH


def test_credits_beyond_the_announced_receives_are_bad_frame() -> None:
    a, _ = pair()
    with pytest.raises(BadFrame, match="returned 1 credits"):
        a.flow.returned(1)  # all 32 are still unused
    assert a.flow.state is FlowState.FAILED


def test_a_peer_with_fewer_than_two_receives_is_refused() -> None:
    with pytest.raises(BadRequest, match="at least 2"):
        Credits(1, DEPTH)
    qp = QpInfo(1, 2, 3, 1, bytes(16), 0, 5)
    with pytest.raises(BadRequest, match="2-4096"):
        ChannelSetup(qp, 1, 65536)
    raw = bytearray(ChannelSetup(qp, 32, 65536).to_bytes())
    assert ChannelSetup.from_bytes(bytes(raw)).recv_depth == 32
    raw[4] = 1  # the version before credits
    with pytest.raises(BadRequest, match="credit flow control"):
        ChannelSetup.from_bytes(bytes(raw))


def test_the_dispatcher_hands_a_messages_immediate_over_before_the_message() -> None:
    seen: list[tuple[str, object]] = []
    d: Dispatcher[str] = Dispatcher(
        WrIds(4), on_send_done=lambda i, e: None, on_imm=lambda *a: None,
        on_message=lambda peer, qpn, slot, n: seen.append(("msg", (slot, n))),
        repost=lambda qpn, slot: None, on_broken=lambda peer, why: seen.append(("x", why)),
        on_credits=lambda peer, n: seen.append(("credits", n)))
    d.qps[9] = QpRole("ch", write=False)
    d.dispatch(Completion(wr_id(WrKind.RECV, 3), WcStatus.SUCCESS, WcOpcode.RECV, 9, 100,
                          socket.htonl(17), IBV_WC_WITH_IMM))
    d.dispatch(Completion(wr_id(WrKind.RECV, 4), WcStatus.SUCCESS, WcOpcode.RECV, 9, 0))
    assert seen == [("credits", 17), ("msg", (3, 100)), ("msg", (4, 0))]
