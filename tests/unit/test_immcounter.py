"""ImmCounter: counting, expectations (before and after landing), consumption, order,
independence of immediates, cancel, adds from many threads at once, and the cap on
counts held (engine.max_counters) where the NIC lands before anyone asks."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest

from transferd.engine.immcounter import ImmCounter
from transferd.engine.port import EnginePort
from transferd.engine.regions import RegionTable
from transferd.protocol.errors import OutOfMemory
from transferd.protocol.peer_landing import Landing


class Fired:
    """A callback that records how often it ran."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


def test_counts_per_immediate() -> None:
    c = ImmCounter()
    assert c.value(1) == 0
    c.add(1)
    c.add(1, 3)
    c.add(2)
    assert (c.value(1), c.value(2), c.value(3)) == (4, 1, 0)
    c.add(0xFFFFFFFF, 2)
    assert c.value(0xFFFFFFFF) == 2 and c.value(0) == 0


def test_expectation_fires_when_count_reached_and_consumes() -> None:
    c = ImmCounter()
    f = Fired()
    c.expect(7, 3, f)
    c.add(7)
    c.add(7)
    assert f.n == 0 and c.value(7) == 2
    c.add(7)
    assert f.n == 1
    assert c.value(7) == 0  # consumed
    c.add(7, 5)
    assert f.n == 1  # fires once only
    assert c.value(7) == 5


def test_expectation_after_landing_fires_at_once() -> None:
    c = ImmCounter()
    c.add(9, 4)
    f = Fired()
    c.expect(9, 3, f)
    assert f.n == 1
    assert c.value(9) == 1  # only what it asked for was consumed
    g = Fired()
    c.expect(9, 2, g)
    assert g.n == 0
    c.add(9)
    assert g.n == 1 and c.value(9) == 0


def test_overshoot_in_one_add() -> None:
    c = ImmCounter()
    f = Fired()
    c.expect(1, 2, f)
    c.add(1, 5)
    assert f.n == 1 and c.value(1) == 3


def test_zero_count_fires_immediately() -> None:
    c = ImmCounter()
    f = Fired()
    c.expect(3, 0, f)
    assert f.n == 1 and c.value(3) == 0


def test_immediates_are_independent() -> None:
    c = ImmCounter()
    a, b = Fired(), Fired()
    c.expect(1, 2, a)
    c.expect(2, 2, b)
    c.add(2)
    c.add(1)
    c.add(3, 10)
    assert (a.n, b.n) == (0, 0)
    c.add(1)
    assert (a.n, b.n) == (1, 0)
    assert c.value(2) == 1 and c.value(3) == 10
    c.add(2)
    assert (a.n, b.n) == (1, 1)
    assert c.value(3) == 10


def test_several_expectations_served_in_order() -> None:
    c = ImmCounter()
    order: list[str] = []
    c.expect(5, 2, lambda: order.append("first"))
    c.expect(5, 1, lambda: order.append("second"))
    c.expect(5, 3, lambda: order.append("third"))
    c.add(5)
    # The head needs 2: the one behind it (needing 1) waits its turn.
    assert order == []
    c.add(5)
    assert order == ["first"]
    c.add(5)
    assert order == ["first", "second"]
    c.add(5, 2)
    assert order == ["first", "second"]
    c.add(5)
    assert order == ["first", "second", "third"]
    assert c.value(5) == 0


def test_one_add_can_fire_several() -> None:
    c = ImmCounter()
    order: list[int] = []
    for i in range(4):
        c.expect(8, 1, lambda i=i: order.append(i))
    c.add(8, 3)
    assert order == [0, 1, 2]
    c.add(8)
    assert order == [0, 1, 2, 3]


def test_round_after_round() -> None:
    # One immediate, reused layer after layer (the KV-cache pattern).
    c = ImmCounter()
    for _ in range(5):
        f = Fired()
        c.expect(42, 4, f)
        for _ in range(4):
            assert f.n == 0
            c.add(42)
        assert f.n == 1 and c.value(42) == 0


def test_cancel() -> None:
    c = ImmCounter()
    a, b = Fired(), Fired()
    c.expect(1, 2, a)
    c.expect(2, 1, a)
    c.expect(1, 1, b)
    assert c.cancel(a) == 2
    assert c.cancel(a) == 0
    c.add(1)
    # a's expectation (which was first) is gone, so b is served; a never fires.
    assert (a.n, b.n) == (0, 1)
    c.add(2, 3)
    assert a.n == 0
    assert c.value(2) == 3  # nothing consumed for a cancelled expectation
    assert c.cancel(Fired()) == 0


def test_notify_runs_callbacks_outside_the_lock() -> None:
    handed: list[Callable[[], None]] = []
    c = ImmCounter(notify=handed.append)
    f = Fired()
    c.expect(1, 1, f)
    c.add(1)
    assert f.n == 0 and len(handed) == 1  # handed to notify, not run
    handed[0]()
    assert f.n == 1
    # With direct notify, a callback may use the counter (no deadlock: the lock is free).
    direct = ImmCounter()
    seen: list[int] = []

    def reenter() -> None:
        seen.append(direct.value(2))
        direct.expect(2, 1, lambda: seen.append(-1))

    direct.expect(2, 1, reenter)
    t = threading.Thread(target=direct.add, args=(2, 2))
    t.start()
    t.join(5)
    assert not t.is_alive(), "a callback deadlocked on the counter's lock"
    assert seen == [1, -1]


def test_adds_from_many_threads() -> None:
    c = ImmCounter()
    threads_n, per = 8, 2000
    imms = (1, 2, 3)
    fired = {i: Fired() for i in imms}
    big = Fired()
    lock = threading.Lock()
    # Expectations of 1 each, many of them, plus one big one on another immediate.
    for i in imms:
        for _ in range(per):
            c.expect(i, threads_n, fired[i])
    c.expect(99, threads_n * per, big)
    barrier = threading.Barrier(threads_n)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            barrier.wait(10)
            for _ in range(per):
                for i in rng.sample(imms, len(imms)):
                    c.add(i)
                c.add(99)
        except BaseException as exc:  # pragma: no cover - reported below
            with lock:
                errors.append(exc)

    ts = [threading.Thread(target=work, args=(s,)) for s in range(threads_n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts)
    assert not errors
    for i in imms:
        assert fired[i].n == per, i
        assert c.value(i) == 0
    assert big.n == 1 and c.value(99) == 0


def test_expect_racing_with_adds() -> None:
    # Expectations registered on one thread while others add: each fires exactly once
    # and the counts add up.
    c = ImmCounter()
    n_adders, per = 4, 3000
    got = Fired()
    lock = threading.Lock()

    def counted() -> None:
        with lock:
            got.n += 1

    def add() -> None:
        for _ in range(per):
            c.add(11)

    ts = [threading.Thread(target=add) for _ in range(n_adders)]
    for t in ts:
        t.start()
    expects = n_adders * per // 10
    for _ in range(expects):
        c.expect(11, 10, counted)
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts)
    assert got.n == expects
    assert c.value(11) == 0


def test_what_an_add_meets_runs_through_now_and_a_met_expect_through_notify() -> None:
    # A landing's add may run the callbacks it met at once (the engine does, on its own
    # loop); an expectation met when it is made never fires within its own call.
    later: list[Callable[[], None]] = []
    now: list[Callable[[], None]] = []
    c = ImmCounter(notify=later.append, now=lambda fn: (now.append(fn), fn()))
    f, g = Fired(), Fired()
    c.expect(3, 2, f)
    assert c.add(3) == 0 and not now
    assert c.add(3) == 1 and f.n == 1 and len(now) == 1 and not later
    c.add(4, 5)
    c.expect(4, 5, g)
    assert g.n == 0 and len(later) == 1  # met already: handed on, not run
    later[0]()
    assert g.n == 1


def test_a_count_the_nic_placed_past_max_counters_is_refused_not_held() -> None:
    """verbs: a WRITE_WITH_IMM's bytes are placed before anyone asks for room, so the
    count itself is what is refused (its link then closed by the Domain): the table
    stays at the cap however many immediates a peer makes up."""
    counter = ImmCounter(max_counters=2)
    landing = Landing(EnginePort(RegionTable(), counter, lambda *a: None, lambda s: None))
    landing.landed_imm(1, 4096)
    landing.landed_imm(2, 4096)
    with pytest.raises(OutOfMemory, match="max_counters"):
        landing.landed_imm(3, 4096)
    assert counter.held() == 2 and counter.value(3) == 0
    assert landing.refused_by == {OutOfMemory.code.value: 1}
    landing.landed_imm(2 | (1 << 32), 4096)  # (an immediate is 32 bits) one held: counts
    assert counter.value(2) == 2 and landing.imms_in == 3
    fired = Fired()
    counter.expect(1, 1, fired)  # consumes 1's count: room for one more
    assert fired.n == 1
    landing.landed_imm(3, 4096)
    assert counter.value(3) == 1
