"""Memory is counted by what is really held: the attacks of issue 7, against live daemons.

Each test reads the daemon's resident memory (VmRSS in /proc/PID/status) and the
usage it reports (GET_DEVICES, metrics).  RSS may grow by at most the device's
limit plus OVERHEAD over what it was before the attack (OVERHEAD covers the
allocator's and the interpreter's own growth while serving), and the reported
usage is what is held, to the byte.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import DaemonFactory
from tests.helpers import RawConn, metric, rss, scrape, wait_until
from transferd.memory import PAGE, charge_of
from transferd.protocol.constants import Command, Flag

MiB = 1 << 20
# What serving the attack may add to the daemon's RSS beyond the buffers
# themselves: frame buffers, Python objects of the connections, malloc arenas.
OVERHEAD = 16 * MiB


def device(conn: RawConn, name: str = "cpu") -> dict[str, Any]:
    f = conn.request(Command.GET_DEVICES)
    return next(d for d in f.body["devices"] if d["name"] == name)


def ok(f: Any) -> Any:
    assert not f.is_error, f.body
    return f


def command_count(conn: RawConn, cmd: Command) -> int:
    return int(conn.request(Command.STATS).body["commands"][cmd.name])


def test_a_get_never_read_keeps_its_buffer_charged_after_free(
    daemon_factory: DaemonFactory,
) -> None:
    """-m 128: allocate, GET never read, free, repeat: the daemon no longer grows."""
    d = daemon_factory(["-m", "128"])
    ctl = RawConn.to(d)
    ctl.hello()
    base = rss(d)
    size = 100 * MiB
    total = device(ctl)["total"]
    for round_ in range(3):
        reader = RawConn.to(d)
        reader.hello()
        buf = ok(ctl.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": size})).body["buffer"]
        ok(ctl.request(Command.BUFFER_CLEAR, {"buffer": buf, "value": 7}))  # every page touched
        gets = command_count(ctl, Command.GET_TENSOR)
        reader.send(Command.GET_TENSOR, {"tensor": [buf, 0, size]})  # and never read
        assert wait_until(lambda n=gets: command_count(ctl, Command.GET_TENSOR) == n + 1)
        ok(ctl.request(Command.FREE_BUFFER, {"buffer": buf}))
        # Freed, but the reply still sends from it: held, and counted as held.
        assert device(ctl)["free"] == total - charge_of(size)
        m = scrape(d.metrics_url or "")
        assert metric(m, "transferd_buffer_allocated_bytes", device="cpu") == charge_of(size)
        assert metric(m, "transferd_buffer_lingering_bytes", device="cpu") == charge_of(size)
        again = ctl.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": size})
        assert again.is_error and again.body["code"] == "OUT_OF_MEMORY", again.body
        assert rss(d) - base <= 128 * MiB + OVERHEAD, (round_, rss(d) - base)
        reader.sock.close()  # the reader goes: the reply lets go of the memory
        assert wait_until(lambda: device(ctl)["free"] == total), device(ctl)
        m = scrape(d.metrics_url or "")
        assert metric(m, "transferd_buffer_lingering_bytes", device="cpu") == 0
        assert wait_until(lambda: rss(d) - base <= OVERHEAD), rss(d) - base
    assert d.alive()


def test_many_tiny_buffers_cost_what_they_hold(daemon_factory: DaemonFactory) -> None:
    """-m 16: 30,000 one-byte buffers asked for; only what fits the limit is given."""
    d = daemon_factory(["-m", "16"])
    c = RawConn.to(d, timeout=30)
    c.hello()
    base = rss(d)
    asked, chunk = 30_000, 500
    got: list[int] = []
    refused = 0
    for _round in range(asked // chunk):  # pipelined, a chunk at a time
        for _ in range(chunk):
            c.send(Command.ALLOC_BUFFER, {"device": "cpu", "size": 1})
        for _ in range(chunk):
            f = c.recv()
            if f.is_error:
                assert f.body["code"] == "OUT_OF_MEMORY", f.body
                refused += 1
            else:
                got.append(f.body["buffer"])
    assert len(got) == 16 * MiB // charge_of(1) == 2048 and refused == asked - len(got)
    # Touch each one (a byte written maps its page), the same pipelined way.
    for start in range(0, len(got), chunk):
        for b in got[start : start + chunk]:
            c.send(Command.SET_TENSOR, {"tensor": [b, 0, 1]}, b"x")
        for _ in got[start : start + chunk]:
            ok(c.recv())
    dev = device(c)
    assert dev["free"] == 16 * MiB - len(got) * charge_of(1) == 0
    grown = rss(d) - base
    assert grown <= 16 * MiB + OVERHEAD, grown
    # Each buffer really costs about its page plus its bookkeeping.
    assert grown >= len(got) * PAGE, grown
    for start in range(0, len(got), chunk):
        for b in got[start : start + chunk]:
            c.send(Command.FREE_BUFFER, {"buffer": b})
        for _ in got[start : start + chunk]:
            ok(c.recv())
    assert device(c)["free"] == 16 * MiB


def test_zero_limit_and_limit_plus_one_over_the_wire(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(["-m", "4"])
    c = RawConn.to(d)
    c.hello()
    dev = device(c)
    assert dev["max_size"] == 4 * MiB - dev["per_buffer"]
    for size in (dev["max_size"] + 1, 1 << 63, 4 * MiB):
        f = c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": size})
        assert f.is_error and f.body["code"] == "OUT_OF_MEMORY", (size, f.body)
    big = ok(c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": dev["max_size"]}))
    assert device(c)["free"] == 0
    f = c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 0})
    assert f.is_error and f.body["code"] == "OUT_OF_MEMORY"
    ok(c.request(Command.FREE_BUFFER, {"buffer": big.body["buffer"]}))
    zero = ok(c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 0}))
    assert device(c)["free"] == 4 * MiB - charge_of(0)
    r = c.request(Command.GET_TENSOR, {"tensor": [zero.body["buffer"], 0, 0]})
    assert not r.is_error and r.payload_len == 0
    ok(c.request(Command.FREE_BUFFER, {"buffer": zero.body["buffer"]}))
    assert device(c)["free"] == 4 * MiB


@pytest.mark.parametrize("no_reply", [False, True])
def test_a_blocked_get_survives_free_with_its_bytes(
    daemon_factory: DaemonFactory, no_reply: bool
) -> None:
    """A GET reply stuck in the transport, its buffer freed: the reader gets the old bytes."""
    d = daemon_factory(["-m", "64"])
    ctl = RawConn.to(d)
    ctl.hello()
    reader = RawConn.to(d, timeout=30)
    reader.hello()
    size = 32 * MiB
    buf = ok(ctl.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": size})).body["buffer"]
    ok(ctl.request(Command.BUFFER_CLEAR, {"buffer": buf, "value": 0x5A}))
    gets = command_count(ctl, Command.GET_TENSOR)
    seq = reader.send(Command.GET_TENSOR, {"tensor": [buf, 0, size]},
                      flags=Flag.NO_REPLY if no_reply else 0)
    assert wait_until(lambda: command_count(ctl, Command.GET_TENSOR) == gets + 1)
    ok(ctl.request(Command.FREE_BUFFER, {"buffer": buf}))
    # Another buffer takes what is free now, and is written: the old pages are not reused.
    other = ok(ctl.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": 16 * MiB}))
    ok(ctl.request(Command.BUFFER_CLEAR, {"buffer": other.body["buffer"], "value": 0xEE}))
    if no_reply:
        # A GET sent one-way has no reply to hold: nothing comes, nothing is held.
        assert device(ctl)["free"] == 64 * MiB - charge_of(16 * MiB)
        return
    f = reader.recv()
    assert f.seq == seq and not f.is_error and f.payload == b"\x5a" * size
    assert wait_until(lambda: device(ctl)["free"] == 64 * MiB - charge_of(16 * MiB))


def test_a_batched_get_holds_every_buffer_it_sends_from(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(["-m", "64"])
    ctl = RawConn.to(d)
    ctl.hello()
    reader = RawConn.to(d)
    reader.hello()
    size = 12 * MiB
    bufs = [ok(ctl.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": size})).body["buffer"]
            for _ in range(3)]
    for b in bufs:
        ok(ctl.request(Command.BUFFER_CLEAR, {"buffer": b, "value": b}))
    n = command_count(ctl, Command.GET_TENSORS)
    # Two tensors of the first buffer, one of each other: one reply, never read.
    reader.send(Command.GET_TENSORS, {"tensors": [[bufs[0], 0, size // 2], [bufs[1], 0, size],
                                                  [bufs[0], size // 2, size // 2],
                                                  [bufs[2], 0, size]]})
    assert wait_until(lambda: command_count(ctl, Command.GET_TENSORS) == n + 1)
    for b in bufs:
        ok(ctl.request(Command.FREE_BUFFER, {"buffer": b}))
    assert device(ctl)["free"] == 64 * MiB - 3 * charge_of(size)
    f = reader.recv()  # now read it: every byte as it was, then all three let go
    assert not f.is_error and f.payload is not None
    expect = bytes([bufs[0]]) * size + bytes([bufs[1]]) * size + bytes([bufs[2]]) * size
    assert f.payload == bytearray(expect[:size // 2] + expect[size:2 * size]
                                  + expect[size // 2:size] + expect[2 * size:])
    assert wait_until(lambda: device(ctl)["free"] == 64 * MiB), device(ctl)
