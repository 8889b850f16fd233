"""The region table attacked from one client connection (REG_MR, pipelined): what the
daemon's loop spends when a connection with many registered buffers closes, and what
one buffer registered again and again costs."""

from __future__ import annotations

import time

from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, rss
from transferd.protocol.constants import Command, Flag
from transferd.protocol.frames import encode_frame


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


def _rss_mib(d: DaemonProcess) -> float:
    return rss(d) / (1 << 20)


def test_one_buffer_registered_again_and_again_is_bounded_by_engine_max_regions(
        daemon_factory: DaemonFactory) -> None:
    """REG_MR of one 4 KiB buffer, pipelined one-way: every one was taken, each a region
    of about 2.3 KiB of the daemon's memory that no limit charges (100,000: +228 MiB;
    without end, the OOM killer). Now at most engine.max_regions are held: the next is
    OUT_OF_MEMORY naming the key (an EVENT|ERROR for a one-way one), the connection
    goes on, and a DEREG_MR makes room again."""
    cap = 1000
    d = daemon_factory(env={"TRANSFERD_ENGINE_MAX_REGIONS": str(cap)})
    c = RawConn.to(d, timeout=120)
    c.hello()
    (buf,) = _buffers(c, 1)
    before = _rss_mib(d)
    tries = 20_000
    for _ in range(tries):
        c.send(Command.REG_MR, {"buffer": buf}, flags=Flag.NO_REPLY)
    sync = c.send(Command.SYNCHRONIZE, {})
    refused = 0
    while True:
        f = c.recv()
        if f.seq == sync and not f.is_event:
            break
        assert f.is_event and f.is_error, f
        assert f.body["code"] == "OUT_OF_MEMORY", f.body
        assert "engine.max_regions" in f.body["message"], f.body
        refused += 1
    assert refused == tries - cap
    grew = _rss_mib(d) - before
    assert grew < 16, f"the daemon grew {grew:.1f} MiB"
    # Answered (not one-way): the same refusal; after a DEREG_MR, a region again.
    f = c.request(Command.REG_MR, {"buffer": buf})
    assert f.is_error and f.body["code"] == "OUT_OF_MEMORY", f
    listing = c.request(Command.STATS, {"buffers": True}).body["buffers"]
    regions = listing[0]["regions"]
    assert len(regions) == cap
    assert not c.request(Command.DEREG_MR, {"mr": regions[0]["id"]}).is_error
    f = c.request(Command.REG_MR, {"buffer": buf})
    assert not f.is_error, f
    assert f.body["mr"] not in {r["id"] for r in regions}
    c.close()


def test_a_buffer_listing_is_bounded_in_regions_too(daemon_factory: DaemonFactory) -> None:
    """STATS {"buffers": true} listed every region of the daemon (walked even for
    buffers past the listing's 10,000): one buffer registered 65,000 times made each
    listing 0.3 s of the loop and 2.7 MB, and ten pipelined held another client's
    round trip 2.2 s. Now at most 10,000 regions are listed (the listing says it was
    cut), only those of the buffers listed."""
    d = daemon_factory()
    c = RawConn.to(d, timeout=120)
    c.hello()
    (buf,) = _buffers(c, 1)
    for _ in range(65):
        c.send_raw(b"".join(encode_frame(Command.REG_MR, Flag.NO_REPLY, 10 + i,
                                         {"buffer": buf}) for i in range(1000)))
    assert not c.request(Command.SYNCHRONIZE, {}).is_error
    body = c.request(Command.STATS, {"buffers": True}).body
    assert body["truncated"] is True
    assert len(body["buffers"][0]["regions"]) == 10_000
    other = RawConn.to(d, timeout=60)
    other.hello()
    for _ in range(10):
        c.send(Command.STATS, {"buffers": True})
    worst = 0.0
    got = 0
    end = time.monotonic() + 60
    c.sock.settimeout(0.01)
    while got < 10 and time.monotonic() < end:
        t0 = time.monotonic()
        assert not other.request(Command.GET_DEVICES, {}).is_error
        worst = max(worst, time.monotonic() - t0)
        try:
            while got < 10:
                c.recv()
                got += 1
        except (TimeoutError, OSError):
            pass
    assert got == 10
    assert worst < 1.0, f"another client waited {worst:.2f} s behind the listings"
    c.close()
    other.close()
