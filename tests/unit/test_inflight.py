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
