"""The in-flight table: stages, progress, the stall warning once per stage."""

from __future__ import annotations

import logging

import pytest

from transferd.engine.inflight import InFlight, Stage
from transferd.parts import Transfer, WritePart
from transferd.protocol import trace
from transferd.protocol.values import NetAddr

TP = trace.parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def parts(n: int) -> list[WritePart]:
    dst = NetAddr(0xABC, 0, (b"127.0.0.1:1", b"127.0.0.1:2"))
    return [WritePart(i % 2, dst, 1, [0x1000 * i], [1000], [memoryview(bytes(1000))], 5,
                      index=i, op=7, trace=TP) for i in range(n)]


def test_a_transfer_moves_through_its_stages(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    t = InFlight(clock, stall_warn_s=1.0)
    plan = parts(4)
    e = t.add(7, "write", op=7, plan=plan, trace=TP, stage=Stage.WAITING_PEER)
    assert (e.peer, e.rails, e.nbytes) == (f"{0xABC:016x}", (0, 1), 4000)
    clock.now += 0.5
    assert t.stalled() == []
    clock.now += 0.6
    with caplog.at_level(logging.WARNING, "transferd.engine"):
        assert t.stalled() == [e]
        assert t.stalled() == []  # once per stage
    (rec,) = caplog.records
    assert "waiting for a peer slot for 1.1 s" in rec.getMessage()
    assert rec.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"  # type: ignore[attr-defined]
    tr = Transfer(7, 4, 4000, lambda err: None)
    e.transfer = tr
    e.move(Stage.SENT, clock.now)
    tr.part_done()
    body = t.listing()["entries"][0]
    assert body["stage"] == "partly acknowledged" and (body["done"], body["total"]) == (
        1000, 4000)
    assert body["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    clock.now += 1.5
    assert t.stalled() == [e] and t.stalls == 2  # a new stage may stall again
    t.remove(7)
    assert len(t) == 0 and t.listing()["entries"] == []


def test_expectations_and_order() -> None:
    clock = Clock()
    t = InFlight(clock)
    have = [0]
    t.add("x", "expectation", stage=Stage.EXPECTING, progress=lambda: (have[0], 3),
          what="imm 9 count 3")
    clock.now += 1
    t.add(8, "write", op=8, plan=parts(1))
    have[0] = 2
    first, second = t.listing()["entries"]
    assert first["kind"] == "expectation" and (first["done"], first["total"]) == (2, 3)
    assert second["op"] == 8 and second["age_s"] == 0.0
    assert t.stalled() == []  # stall_warn_s = 0: never


def test_a_costly_listing_is_handed_again_for_nine_times_its_cost() -> None:
    """Twenty connections listing 131,072 expectations at once (0.1 s each) held every
    other client 0.5 s. A listing that took longer than ``reuse_over_s`` is now the
    answer again, the same body, for nine times what it cost; a cheap one never is."""
    import time

    t = InFlight(Clock())
    t.add("a", "expectation", stage=Stage.EXPECTING)
    first = t.listing()
    t.add("b", "expectation", stage=Stage.EXPECTING)
    second = t.listing()  # cheap (one entry): made again, the new entry in it
    assert second is not first and len(second["entries"]) == 2
    t.reuse_over_s = 0.0  # every listing counts as costly here
    for i in range(2000):
        t.add(i, "expectation", stage=Stage.EXPECTING)
    began = time.perf_counter()
    big = t.listing()
    cost = time.perf_counter() - began
    t.add("late", "expectation", stage=Stage.EXPECTING)
    if time.perf_counter() - began < 9 * cost * 0.9:  # (a stalled test host: not judged)
        assert t.listing() is big and len(big["entries"]) == 2002
    assert t.listing(limit=5) is not big  # another limit is another listing
    time.sleep(10 * cost + 0.01)
    fresh = t.listing()
    assert fresh is not big and len(fresh["entries"]) == 2003
