"""PeerSlots (engine/peer_slots.py) on a real loop: per-peer bounds, FIFO waiting that
holds nothing else back, transfers to several peers, expiry of a wait."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from tests.helpers import async_test
from transferd.engine.peer_slots import PeerSlots
from transferd.protocol.errors import Cancelled, OverLimit, Timeout

P, Q, R = (1, 0), (2, 0), (3, 0)


class Starts:
    """start(releases) callbacks whose futures the test finishes by hand, in the order
    started; each lets go of what it was handed once its future is done, as the
    engine's transfers do."""

    def __init__(self) -> None:
        self.started: list[tuple[str, asyncio.Future[None]]] = []

    def __call__(self, name: str):  # type: ignore[no-untyped-def]
        def start(releases) -> asyncio.Future[None]:  # type: ignore[no-untyped-def]
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            fut.add_done_callback(lambda _: [r() for r in releases])
            self.started.append((name, fut))
            return fut
        return start

    def names(self) -> list[str]:
        return [n for n, _ in self.started]

    def finish(self, name: str) -> None:
        for n, f in self.started:
            if n == name and not f.done():
                f.set_result(None)
                return
        raise AssertionError(name)


async def _turns() -> None:
    """Two turns of the loop: a finished transfer lets go of its slot in one (its done
    callback here, its end in the engine), and the waiters it freed start on a turn of
    their own, the next."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


@async_test()
async def test_a_full_peer_makes_its_own_wait_and_nobody_else() -> None:
    slots = PeerSlots(asyncio.get_running_loop(), per_peer=2, timeout_s=30)
    s = Starts()
    futs = {n: slots.run([P], s(n)) for n in ("p1", "p2", "p3", "p4")}
    q1 = slots.run([Q], s("q1"))  # another peer: at once, past P's queue
    assert s.names() == ["p1", "p2", "q1"] and slots.waiting == 2
    assert slots.in_flight(P) == 2 and slots.in_flight(Q) == 1
    s.finish("p2")
    await _turns()
    assert s.names() == ["p1", "p2", "q1", "p3"]  # FIFO: p3 before p4
    s.finish("q1")
    await q1
    s.finish("p1")
    s.finish("p3")
    await _turns()
    s.finish("p4")
    for f in futs.values():
        await asyncio.wait_for(f, 1)
    assert slots.waiting == 0 and slots.in_flight(P) == 0 and slots.waited == 2


@async_test()
async def test_a_transfer_to_several_peers_takes_a_slot_of_each() -> None:
    slots = PeerSlots(asyncio.get_running_loop(), per_peer=1, timeout_s=30)
    s = Starts()
    slots.run([P], s("p"))
    slots.run([Q], s("q"))
    both = slots.run([P, Q, R], s("pqr"))
    assert s.names() == ["p", "q"]
    s.finish("p")
    await _turns()
    assert s.names() == ["p", "q"]  # P is free, Q is not: it waits on Q now
    r_only = slots.run([R], s("r"))  # R is free and nobody waits for it
    assert s.names() == ["p", "q", "r"]
    s.finish("r")
    await r_only
    s.finish("q")
    await _turns()
    assert s.names()[-1] == "pqr" and all(slots.in_flight(k) == 1 for k in (P, Q, R))
    s.finish("pqr")
    await asyncio.wait_for(both, 1)


@async_test()
async def test_a_wait_expires_unsent_and_a_typed_start_error_is_the_transfers() -> None:
    slots = PeerSlots(asyncio.get_running_loop(), per_peer=1, timeout_s=0.05)
    s = Starts()
    slots.run([P], s("p1"))
    late = slots.run([P], s("p2"))
    with pytest.raises(Timeout, match="not sent"):
        await asyncio.wait_for(late, 1)
    assert slots.waiting == 0 and slots.expired == 1

    def bad(releases: object) -> asyncio.Future[None]:
        raise OverLimit("refused at start")
    refused = slots.run([P], bad)
    s.finish("p1")  # p2 expired: skipped; bad() starts and fails its own future
    with pytest.raises(OverLimit, match="refused at start"):
        await asyncio.wait_for(refused, 1)
    assert s.names() == ["p1"] and slots.in_flight(P) == 0


@async_test()
async def test_waiting_is_bounded() -> None:
    slots = PeerSlots(asyncio.get_running_loop(), per_peer=1, timeout_s=30, max_waiting=3)
    s = Starts()
    for i in range(4):
        slots.run([P], s(f"p{i}"))
    with pytest.raises(OverLimit, match="wait for a slot"):
        slots.run([P], s("one too many"))
    assert slots.run([Q], s("q")) is not None  # a free peer is never refused


@async_test()
async def test_a_waiting_transfer_can_be_cancelled_and_a_started_one_found() -> None:
    slots = PeerSlots(asyncio.get_running_loop(), per_peer=1, timeout_s=30)
    s = Starts()
    first = slots.run([P], s("p1"))
    assert slots.started(first) is first  # it never waited
    waiting = slots.run([P], s("p2"))
    later = slots.run([P], s("p3"))
    assert slots.cancel(waiting, Timeout("its own deadline"))
    assert not slots.cancel(waiting, Timeout("twice"))
    with pytest.raises(Timeout, match="its own deadline"):
        await waiting
    assert slots.waiting == 1
    s.finish("p1")
    await _turns()
    assert s.names() == ["p1", "p3"]  # the cancelled one never started
    assert slots.started(later) is s.started[1][1]
    assert not slots.cancel(later, Timeout("started: not here"))
    s.finish("p3")
    await asyncio.wait_for(later, 1)
    assert slots.started(later) is later  # forgotten once done


class _Source:
    """What a waiting transfer's start holds (its parts, views of its source)."""


async def _held_after(slots: PeerSlots, n: int, end: str) -> int:
    """How many of ``n`` waiters that ended while they waited (``end``: cancelled, or
    expired) are still held by the slots, a peer's slot busy all along."""
    refs = []
    for i in range(n):
        src = _Source()
        refs.append(weakref.ref(src))

        def start(releases, src=src):  # type: ignore[no-untyped-def]
            raise AssertionError(f"a waiter that ended started ({src})")

        fut = slots.run([P], start)
        if end == "cancelled":
            assert slots.cancel(fut, Cancelled("cancelled by the test"))
        elif i % 50 == 49:
            await asyncio.sleep(0.01)  # past timeout_s: the last 50 expire
        del src, start, fut
    await asyncio.sleep(0.01)
    gc.collect()
    return sum(r() is not None for r in refs)


@pytest.mark.parametrize("end", ["cancelled", "expired"])
@async_test()
async def test_waiters_that_ended_are_let_go_while_the_peer_stays_busy(end: str) -> None:
    """A peer that finishes nothing, and a client that queues a write to it and cancels
    it (or lets it expire), over and over: the queue keeps at most a bounded number of
    the dead waiters (and what their starts hold), not one per write ever queued."""
    slots = PeerSlots(asyncio.get_running_loop(), per_peer=1, timeout_s=0.001,
                      max_waiting=100)
    s = Starts()
    slots.run([P], s("stuck"))  # the one slot, never freed
    held = await _held_after(slots, 3000, end)
    assert held <= 2 * slots.max_waiting, f"{held} of 3000 ended waiters still held"
    # The queue still works: the slot freed, a fresh waiter (a deadline it keeps) starts.
    slots.timeout_s = 30
    fut = slots.run([P], s("next"))
    s.finish("stuck")
    await _turns()
    assert s.names() == ["stuck", "next"] and slots.waiting == 0
    s.finish("next")
    await fut
