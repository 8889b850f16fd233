"""One connection's pipelined expensive requests against every other client's latency.

A connection's frames run up to 64 per turn of the daemon's loop (PUMP_FRAMES) before
the others get theirs. That bounds the count, not the time: a STATS that lists 10,000
registered buffers takes about 0.1 s (one listing what is in flight among 131,072
expectations 0.12 s), so 40 pipelined held the loop for seconds in one turn (6.4 s
measured with the second), every other client waiting. Now a turn also ends once its
frames have run for a few milliseconds.
"""

from __future__ import annotations

import threading
import time

from tests.conftest import DaemonFactory
from tests.helpers import RawConn
from transferd.protocol.constants import Command, Flag
from transferd.protocol.frames import HEADER, encode_frame


def test_pipelined_expensive_requests_do_not_hold_other_clients_for_a_whole_turn(
        daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    c = RawConn.to(d, timeout=120)
    c.hello()
    # 10,000 registered buffers: what STATS "buffers" lists (about 0.1 s a listing).
    n_buffers = 10_000
    for _ in range(n_buffers):
        c.send(Command.ALLOC_BUFFER, {"device": "cpu", "size": 4096, "owner": "connection"})
    ids = [c.recv().body["buffer"] for _ in range(n_buffers)]
    for b in ids:
        c.send(Command.REG_MR, {"buffer": b}, flags=Flag.NO_REPLY)
    assert not c.request(Command.SYNCHRONIZE, {}).is_error
    t0 = time.monotonic()
    assert len(c.request(Command.STATS, {"buffers": True}).body["buffers"]) == n_buffers
    one = time.monotonic() - t0
    other = RawConn.to(d, timeout=120)
    other.hello()
    n = 40
    # All 40 in one write, so that they are all in the daemon's buffer at once.
    c.send_raw(b"".join(encode_frame(Command.STATS, 0, 1000 + i, {"buffers": True})
                        for i in range(n)))

    def drain() -> None:
        # The replies' headers only (no decoding: this process's own CPU must not be
        # what the other client's round trips measure).
        sock, pending, frames = c.sock, b"", 0
        skip = 0
        while frames < n:
            data = sock.recv(1 << 20)
            assert data, "the daemon closed the connection"
            if skip >= len(data):
                skip -= len(data)
                continue
            pending += data[skip:]
            skip = 0
            while len(pending) >= HEADER.size:
                _, _, _, _, body_len, _, payload_len = HEADER.unpack_from(pending)
                whole = HEADER.size + body_len + payload_len
                frames += 1
                if whole <= len(pending):
                    pending = pending[whole:]
                else:
                    skip, pending = whole - len(pending), b""

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    worst = 0.0
    end = time.monotonic() + 120
    while reader.is_alive() and time.monotonic() < end:
        t0 = time.monotonic()
        assert not other.request(Command.GET_DEVICES, {}).is_error
        worst = max(worst, time.monotonic() - t0)
    reader.join(5)
    assert not reader.is_alive()
    # Before: the listings back to back in one turn (40 x ~0.1 s).
    assert worst < max(1.0, 4 * one), \
        f"another client waited {worst:.2f} s (one listing takes {one:.2f} s)"
    c.close()
    other.close()
