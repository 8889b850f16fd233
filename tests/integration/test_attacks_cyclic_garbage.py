"""What a connection's expectations leave to the garbage collector when it closes.

Each EXPECT_IMM_COUNT's handle was a closure that named itself (to leave its
connection's set when it fired), and its Op kept its stop (which names the handle):
cycles, one per expectation, that reference counting never frees. A connection that
closed with 65,536 waiting (engine.max_expectations, the default) left 1.9 million
objects for the cyclic collector, whose next full pass held the daemon's loop about 2 s:
every client waited. Now an expectation's objects go when it ends, fired, cancelled or
with its connection.
"""

from __future__ import annotations

import gc
import threading
import time

from tests.conftest import DaemonFactory
from tests.helpers import RawConn
from transferd.engine.expectations import Expectations
from transferd.engine.immcounter import ImmCounter
from transferd.protocol.constants import Command, Flag
from transferd.protocol.frames import encode_frame


def test_closing_with_many_expectations_leaves_no_long_collector_pass(
        daemon_factory: DaemonFactory) -> None:
    """Two connections in turn each wait on 65,536 immediates, then close. Before,
    each close left 1.9 million objects in cycles, and the collector's full pass over
    them (during the next connection's requests) held the loop 2.1-2.5 s each time;
    another client's round trips, timed throughout, show it."""
    d = daemon_factory()
    other = RawConn.to(d, timeout=60)
    other.hello()
    stop = threading.Event()
    worst = [0.0]

    def probe() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            assert not other.request(Command.GET_DEVICES, {}).is_error
            worst[0] = max(worst[0], time.monotonic() - t0)
            stop.wait(0.005)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        for _ in range(2):
            c = RawConn.to(d, timeout=120)
            c.hello()
            c.send_raw(b"".join(encode_frame(
                Command.EXPECT_IMM_COUNT, Flag.NO_REPLY, 10 + i,
                {"imm": 1 + i, "count": 1, "timeout_ms": 3_600_000}) for i in range(65536)))
            assert not c.request(Command.SYNCHRONIZE, {}).is_error
            c.close()
            time.sleep(0.5)
    finally:
        stop.set()
        prober.join(30)
    assert not prober.is_alive()
    assert worst[0] < 1.5, f"another client waited {worst[0]:.2f} s"
    other.close()


def test_an_expectations_objects_are_freed_without_the_collector() -> None:
    """In memory: fired, cancelled, or its owner closed, nothing of an expectation is
    left in a reference cycle (gc finds nothing of it to collect)."""
    counter = ImmCounter()
    table = Expectations(counter, limit=100)
    gc.collect()
    gc.disable()
    try:
        gc.collect()  # (whatever the process had left, before the count that matters)
        fired: list[int] = []
        for i in range(10):  # fired
            table.expect("a", 7, 1, lambda i=i: fired.append(i))
        for _ in range(10):
            counter.add(7, 1)
        handles = [table.expect("b", 8, 1, lambda: None) for _ in range(10)]
        for h in handles:  # cancelled
            assert table.cancel("b", h)
        del handles, h
        for _ in range(10):  # their owner gone
            table.expect("c", 9, 1, lambda: None)
        table.closed("c")
        assert len(fired) == 10 and table.pending() == 0
        assert gc.collect() == 0, "an expectation's objects were left in a cycle"
    finally:
        gc.enable()
