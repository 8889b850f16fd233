"""The receive side's rules (transferd/engine/receives.py) on a real loop and a real
BufferTable: who gets a message, when its sender is told, what it is charged."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import async_test
from transferd.engine.receives import OVERHEAD, Receives
from transferd.memory import BufferTable
from transferd.protocol.errors import BadRequest, Cancelled, NotFound, OutOfMemory, OverLimit

MiB = 1 << 20
PEER = (7, 0)


class Conn:
    """A receiving connection: records what it is handed; ``blocked`` = its transport
    keeps what it is handed (a reader that does not read)."""

    def __init__(self, r: Receives, blocked: bool = False) -> None:
        self.r, self.blocked, self.got = r, blocked, []

    def deliver(self, peer: tuple[int, int], msg: bytes) -> bool:
        self.got.append(msg)
        return not self.blocked

    def drain(self) -> None:
        self.blocked = False
        self.r.drained(self)


class Acks:
    def __init__(self) -> None:
        self.results: dict[int, Any] = {}

    def __call__(self, i: int) -> Callable[[Any], None]:
        def ack(err: Any) -> None:
            assert i not in self.results, f"message {i} acknowledged twice"
            self.results[i] = err
        return ack


def make(limit: int = 64 * MiB, wait_s: float = 5.0, max_waiting: int = 1024,
         pools_total: int = 4096) -> tuple[Receives, BufferTable]:
    table = BufferTable(limit)
    r = Receives(lambda n: table.charge("cpu", n, "a waiting message"), max_pools=64,
                 max_pools_total=pools_total, max_waiting=max_waiting, wait_s=wait_s)
    return r, table


@async_test()
async def test_smallest_fitting_receive_and_refusals() -> None:
    r, _ = make()
    acks = Acks()
    r.arrive(PEER, b"x", acks(0))
    assert isinstance(acks.results[0], NotFound)  # nothing posted: refused, not kept
    small, big = Conn(r), Conn(r)
    r.post(small, 16, 1, small.deliver)
    r.post(big, 1024, 1, big.deliver)
    r.arrive(PEER, b"a" * 10, acks(1))
    r.arrive(PEER, b"b" * 100, acks(2))
    assert small.got == [b"a" * 10] and big.got == [b"b" * 100]
    r.arrive(PEER, b"c" * 2000, acks(3))
    assert isinstance(acks.results[3], BadRequest) and "at most 1024" in str(acks.results[3])
    assert acks.results[1] is None and acks.results[2] is None
    assert r.waiting == 0 and r.waiting_bytes == 0


@async_test()
async def test_a_blocked_connection_holds_the_ack_and_gets_nothing_more() -> None:
    r, table = make()
    acks = Acks()
    slow, other = Conn(r, blocked=True), Conn(r)
    r.post(slow, MiB, 100, slow.deliver)
    r.arrive(PEER, b"1" * MiB, acks(1))
    assert slow.got == [b"1" * MiB] and 1 not in acks.results  # in its transport
    assert table.used_on("cpu") == MiB + OVERHEAD  # charged until it drained
    r.arrive(PEER, b"2" * 1000, acks(2))  # waits on slow: its receives are busy
    assert len(slow.got) == 1 and r.waiting == 2
    r.post(other, MiB, 4, other.deliver)  # a later connection never gets message 2
    r.arrive(PEER, b"3" * 10, acks(3))  # ... but a new message may go to it
    assert other.got == [b"3" * 10] and acks.results[3] is None
    slow.drain()
    assert acks.results[1] is None and acks.results[2] is None
    assert slow.got[1] == b"2" * 1000
    assert r.waiting == 0 and table.used_on("cpu") == 0


@async_test()
async def test_waiting_is_charged_capped_and_expires_with_the_sender_told() -> None:
    r, table = make(limit=4 * MiB, wait_s=0.2, max_waiting=5)
    acks = Acks()
    slow = Conn(r, blocked=True)
    r.post(slow, MiB, 1, slow.deliver)
    r.arrive(PEER, b"h" * MiB, acks(0))  # held in the transport (charged)
    for i in range(1, 5):
        r.arrive(PEER, bytes(MiB - 2 * OVERHEAD), acks(i))
    # 4 MiB: the held one and three waiting fit, the fourth does not.
    assert list(acks.results) == [4] and isinstance(acks.results[4], OutOfMemory)
    assert table.used_on("cpu") <= 4 * MiB
    for i in range(5, 9):
        r.arrive(PEER, b"s", acks(i))
    assert sum(isinstance(e, OverLimit) for e in acks.results.values()) >= 1  # 5 at most
    assert r.waiting <= 5
    await asyncio.sleep(0.4)
    expired = [i for i, e in acks.results.items() if isinstance(e, Cancelled)]
    assert {1, 2, 3} <= set(expired) and r.expired == len(expired)
    assert 0 not in acks.results  # the one in the transport does not expire
    slow.drain()
    assert acks.results[0] is None and table.used_on("cpu") == 0 and r.waiting == 0


@async_test()
async def test_close_and_sender_gone_tell_the_senders() -> None:
    r, table = make()
    acks = Acks()
    slow = Conn(r, blocked=True)
    r.post(slow, 64, 1, slow.deliver)
    link_a, link_b = object(), object()
    r.arrive(PEER, b"held", acks(0), link_a)
    r.arrive(PEER, b"w1", acks(1), link_a)
    r.arrive(PEER, b"w2", acks(2), link_b)
    r.sender_gone(link_a)  # its waiting message goes; the held one stays
    assert isinstance(acks.results[1], Cancelled) and 0 not in acks.results
    r.closed(slow)
    assert isinstance(acks.results[0], Cancelled) and isinstance(acks.results[2], Cancelled)
    assert r.waiting == 0 and r.pools == 0 and table.used_on("cpu") == 0
    r.arrive(PEER, b"late", acks(3))
    assert isinstance(acks.results[3], NotFound)


@async_test()
async def test_pool_caps() -> None:
    r, _ = make(pools_total=70)
    one, two = Conn(r), Conn(r)
    for i in range(64):
        r.post(one, 8 + i, 1, one.deliver)
    with pytest.raises(OverLimit, match="max_recv_pools "):
        r.post(one, 8, 1, one.deliver)
    for _ in range(6):
        r.post(two, 8, 1, two.deliver)
    with pytest.raises(OverLimit, match="max_recv_pools_total"):
        r.post(two, 8, 1, two.deliver)
    with pytest.raises(BadRequest):
        r.post(two, 0, 1, two.deliver)
    r.closed(one)
    r.post(two, 8, 1, two.deliver)


@async_test()
async def test_finding_a_receive_does_not_scan_the_pools() -> None:
    """4,096 pools of distinct lengths: 20,000 messages cost about what a few pools
    would (a scan of every pool per message took ~16 ms at 200,000)."""
    r, _ = make(pools_total=1 << 16)
    conns = [Conn(r) for _ in range(64)]
    for i in range(4096):
        c = conns[i % 64]
        r.post(c, 16 + i, 1_000_000, c.deliver)
    acks = Acks()
    t0 = time.perf_counter()
    for i in range(20_000):
        r.arrive(PEER, b"m" * (16 + (i * 7919) % 4096), acks(i))
    per = (time.perf_counter() - t0) / 20_000
    assert all(e is None for e in acks.results.values()) and len(acks.results) == 20_000
    assert per < 200e-6, per  # a scan of 4,096 pools per message would be ~1 ms


@async_test()
async def test_a_receive_longer_than_any_message_is_clamped_and_takes_the_largest() -> None:
    """SUBMIT_RECVS' len is a 64-bit value; a receive is never longer than the largest
    message that can arrive (max_length, a SEND's 1 MiB at the daemon): clamped, so
    it takes every message there is, as asked, and two such posts are equal."""
    table = BufferTable(64 * MiB)
    r = Receives(lambda n: table.charge("cpu", n, "a waiting message"), max_pools=64,
                 max_pools_total=4096, max_waiting=16, wait_s=5.0, max_length=MiB)
    one, two = Conn(r), Conn(r)
    r.post(one, (1 << 64) - 1, 1, one.deliver)
    r.post(two, 4 * MiB, 1, two.deliver)
    assert r._posted.lengths == [MiB]  # both pools: MiB long
    acks = Acks()
    r.arrive(PEER, b"m" * MiB, acks(0))
    r.arrive(PEER, b"n" * MiB, acks(1))
    assert acks.results == {0: None, 1: None} and len(one.got + two.got) == 2
    r.post(one, MiB - 1, 1, one.deliver)  # (a shorter one stays as asked)
    assert r._posted.lengths == [MiB - 1, MiB]
    with pytest.raises(BadRequest):
        r.post(one, 0, 1, one.deliver)


@async_test()
async def test_a_traced_post_is_handed_each_messages_trace_id() -> None:
    r, _ = make()
    got: list[tuple[bytes, bytes | None]] = []
    plain: list[bytes] = []

    def traced(peer: tuple[int, int], msg: bytes, trace: bytes | None) -> bool:
        got.append((msg, trace))
        return True

    a, b = Conn(r), Conn(r)
    r.post(a, 16, 4, traced, traced=True)
    r.post(b, 1024, 4, lambda peer, msg: plain.append(msg) or True)
    acks = Acks()
    tp = bytes(range(26))
    r.arrive(PEER, b"x", acks(0), None, tp, 5)
    r.arrive(PEER, b"y", acks(1))
    r.arrive(PEER, b"z" * 100, acks(2), None, tp, 6)  # (to the untraced post)
    assert got == [(b"x", tp), (b"y", None)] and plain == [b"z" * 100]
    assert all(v is None for v in acks.results.values())


@async_test()
async def test_what_waits_for_a_receive_is_listed_with_its_trace_id() -> None:
    r, _ = make()
    stuck = Conn(r, blocked=True)
    r.post(stuck, 64, 1, stuck.deliver)
    acks = Acks()
    tp = bytes(range(26))
    r.arrive(PEER, b"first", acks(0), None, None, 1)  # in the transport: delivering
    r.arrive(PEER, b"second", acks(1), None, tp, 2)  # waits for the receive
    listed = dict(r.listing())
    by_op = {f["op"]: f for f in listed.values()}
    assert by_op[1]["stage"].value == "delivering" and by_op[1]["progress"] == (5, 5)
    assert by_op[2]["stage"].value == "waiting for a receive"
    assert by_op[2]["progress"] == (0, 6) and by_op[2]["trace"] == tp
    assert by_op[2]["kind"] == "incoming send" and by_op[2]["peer"] == PEER[0]
    assert by_op[2]["owner"] is stuck and by_op[2]["rails"] == (0,)
    assert by_op[2]["started"] <= time.monotonic()
    r.drained(stuck)  # (its transport still keeps what it is handed next)
    listed = dict(r.listing())  # the second is in the transport now
    assert [(f["op"], f["stage"].value) for f in listed.values()] == [(2, "delivering")]
    stuck.drain()
    assert not list(r.listing()) and acks.results == {0: None, 1: None}
