"""The region table attacked from one client connection (REG_MR, pipelined): what the
daemon's loop spends when a connection with many registered buffers closes, and what
one buffer registered again and again costs."""

from __future__ import annotations

import time

from tests.conftest import DaemonFactory
from tests.helpers import RawConn
from transferd.protocol.constants import Command, Flag


def _buffers(c: RawConn, n: int, size: int = 4096) -> list[int]:
    """``n`` connection-owned buffers of ``size`` bytes, allocated pipelined."""
    for _ in range(n):
        c.send(Command.ALLOC_BUFFER, {"device": "cpu", "size": size, "owner": "connection"})
    ids = []
    for _ in range(n):
        f = c.recv()
        assert not f.is_error, f
        ids.append(f.body["buffer"])
    return ids


def test_closing_a_connection_with_many_registered_buffers_does_not_hold_the_loop(
        daemon_factory: DaemonFactory) -> None:
    """Each buffer freed looked for its regions by scanning every region of the daemon
    (``RegionTable.regions_of``), so a connection closing with N registered buffers of
    its own cost N x N: with 20,000 the loop was held 14 s (every other client waited;
    5,000: 0.65 s), 32,768 (memory.max_buffers) about 40 s. Now a buffer's regions are
    found by the buffer: another client's round trip across the close stays short."""
    d = daemon_factory()
    c = RawConn.to(d, timeout=120)
    c.hello()
    n = 16_000
    ids = _buffers(c, n)
    for b in ids:
        c.send(Command.REG_MR, {"buffer": b}, flags=Flag.NO_REPLY)
    assert not c.request(Command.SYNCHRONIZE, {}).is_error
    other = RawConn.to(d, timeout=120)
    other.hello()
    t0 = time.monotonic()
    c.close()
    time.sleep(0.05)  # the close reaches the daemon first
    assert not other.request(Command.GET_DEVICES, {}).is_error
    took = time.monotonic() - t0
    assert took < 2.0, f"another client waited {took:.1f} s across the close"
    # Everything of the closed connection is gone: its buffers and regions.
    listing = other.request(Command.STATS, {"buffers": True}).body
    assert listing["buffers"] == [], listing["buffers"][:3]
    other.close()
