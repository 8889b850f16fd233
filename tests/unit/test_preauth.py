"""transferd/preauth.py: pre-auth slots that strangers cannot keep, verdicts in turn."""

from __future__ import annotations

import random

import pytest

from transferd.preauth import Admission, Ticket, TicketPhase, Why


def test_the_oldest_of_a_full_source_gives_way_and_the_newcomer_gets_in() -> None:
    a = Admission(max_pending=100, max_per_source=3, timeout=5.0)
    olds = [a.admit("10.0.0.1", float(i)).ticket for i in range(3)]
    r = a.admit("10.0.0.1", 3.0)
    assert r.ticket is not None and [t.why for t in r.closed] == [Why.EVICTED_SOURCE]
    assert r.closed[0] is olds[0] and olds[0].phase is TicketPhase.GONE
    assert a.count("10.0.0.1") == 3 and a.pending == 3 and a.evicted == 1
    # Another source is untouched.
    assert a.admit("10.0.0.2", 3.0).closed == []


def test_a_decided_ticket_goes_before_one_still_in_its_handshake() -> None:
    a = Admission(max_pending=100, max_per_source=3, timeout=5.0)
    t0, t1, t2 = (a.admit("s", float(i)).ticket for i in range(3))
    assert t0 and t1 and t2
    at, n = a.failed(t2, 3.0)  # the newest failed: it is the one that gives way
    assert at is not None and n == 1 and t2.phase is TicketPhase.VERDICT
    assert a.admit("s", 3.1).closed == [t2]
    # A held success counts as decided too (an eviction must not tell it from a failure).
    t3 = a.admit("s", 3.02).ticket
    assert t3 is not None
    assert a.success_at(t3, 3.02) == at and t3.phase is TicketPhase.VERDICT
    assert a.admit("s", 3.03).closed == [t3]


def test_a_full_table_takes_from_the_busiest_source() -> None:
    a = Admission(max_pending=8, max_per_source=8, timeout=60.0)
    busy = [a.admit("busy", float(i)).ticket for i in range(6)]
    a.admit("b", 6.0)
    a.admit("c", 6.0)
    # Full: a newcomer from a fresh source takes the busiest source's oldest slot.
    r = a.admit("fresh", 7.0)
    assert r.ticket is not None and r.closed == [busy[0]]
    assert r.closed[0].why is Why.EVICTED_TOTAL
    assert (a.count("busy"), a.count("fresh"), a.pending) == (5, 1, 8)
    # Everyone holding one each: a source holding as many as the busiest gives up its own.
    a2 = Admission(max_pending=3, max_per_source=3, timeout=5.0)
    x, _y, _z = (a2.admit(s, 0.0).ticket for s in "xyz")
    assert a2.admit("x", 1.0).closed == [x]


def test_the_busiest_source_is_tracked_as_counts_move() -> None:
    a = Admission(max_pending=10_000, max_per_source=10_000, timeout=1e9)
    rng = random.Random(7)
    live: list[Ticket] = []
    for i in range(3000):
        if live and rng.random() < 0.45:
            a.release(live.pop(rng.randrange(len(live))))
        else:
            t = a.admit(f"s{rng.randrange(20)}", float(i)).ticket
            assert t is not None
            live.append(t)
        counts = [a.count(f"s{k}") for k in range(20)]
        assert a._max == max(counts), i
    assert a.pending == len(live)


def test_no_slot_outlives_its_deadline() -> None:
    a = Admission(max_pending=10, max_per_source=10, timeout=5.0)
    t = a.admit("s", 0.0).ticket
    assert t is not None and a.next_deadline() == 5.0
    assert a.expire(4.99) == []
    (gone,) = a.expire(5.0)
    assert gone is t and t.why is Why.EXPIRED and a.pending == 0 and a.expired == 1
    # admit() hands out what expired first, so a caller that lost a timer leaks nothing.
    t2 = a.admit("s", 10.0).ticket
    r = a.admit("s", 15.5)
    assert r.closed == [t2] and t2 is not None and t2.why is Why.EXPIRED
    a.release(t2)  # idempotent
    assert a.pending == 1


def test_failures_wait_in_turn_but_never_past_the_deadline() -> None:
    a = Admission(max_pending=1000, max_per_source=1000, timeout=5.0, base=0.05, cap=2.0)
    answers = []
    for _ in range(8):
        t = a.admit("s", 0.0).ticket
        assert t is not None
        answers.append(a.failed(t, 0.0)[0])
    # 0.05, +0.1, +0.2, +0.4, +0.8, +1.6 (3.15 s), +2 would be 5.15 s: past the deadline.
    assert answers[:6] == pytest.approx([0.05, 0.15, 0.35, 0.75, 1.55, 3.15])
    assert answers[6:] == [None, None]
    assert a.failures("s") == 8
    # An unanswered failure did not push the queue: a held success waits only for 3.15 s.
    ok = a.admit("s", 1.0).ticket
    assert ok is not None and a.success_at(ok, 1.0) == pytest.approx(3.15)
    # Another source is answered at once.
    other = a.admit("o", 1.0).ticket
    assert other is not None and a.success_at(other, 1.0) == 1.0
    assert other.phase is TicketPhase.HANDSHAKE  # nothing held: not decided early
    # After the window a source starts again from the base wait.
    t = a.admit("s", 100.0).ticket
    assert t is not None and a.failed(t, 100.0) == (pytest.approx(100.05), 1)


def test_a_held_success_past_the_deadline_gets_no_answer() -> None:
    a = Admission(max_pending=1000, max_per_source=1000, timeout=1.0, base=0.5, cap=0.5)
    t = a.admit("s", 0.0).ticket
    assert t is not None and a.failed(t, 0.0)[0] == 0.5
    late = a.admit("s", 0.0).ticket
    assert late is not None and a.failed(late, 0.0)[0] == 1.0
    ok = a.admit("s", 0.0).ticket
    assert ok is not None and a.success_at(ok, 0.0) == 1.0
    ok2 = a.admit("s", 0.05).ticket
    assert ok2 is not None and a.success_at(ok2, 0.05) == 1.0


def test_the_failure_table_is_bounded() -> None:
    a = Admission(max_pending=10, max_per_source=10, timeout=5.0, max_sources=3)
    for i in range(10):
        t = a.admit(f"s{i}", 0.0).ticket
        assert t is not None
        a.failed(t, 0.0)
        a.release(t)
    assert len(a._fails) == 3 and a.failures("s9") == 1 and a.failures("s0") == 0


def test_a_cap_of_zero_refuses() -> None:
    a = Admission(max_pending=0, max_per_source=5)
    r = a.admit("s", 0.0)
    assert r.ticket is None and "cap of 0" in r.reason and a.refused == 1
