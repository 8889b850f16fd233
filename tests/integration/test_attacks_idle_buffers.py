"""What an authenticated connection that has gone quiet costs the daemon.

Each connection's frame decoder collects headers and bodies in a buffer of its own.
Before, it was given 256 KiB the moment the connection authenticated, and grew to hold
the largest body it had ever received (up to ``server.max_body`` plus 256 KiB), and
kept that for the connection's life: 2,000 idle connections took the daemon +514 MiB,
100 that had each sent one 4 MiB STATS +407 MiB. A client may open as many as the
daemon's descriptors allow (the systemd unit's LimitNOFILE is 1,048,576). Now a buffer
grows while bytes come faster than one receive takes and goes back to its small size
(8 KiB) once everything received is consumed.
"""

from __future__ import annotations

import hashlib
import os
import resource
import time

import pytest

from tests.conftest import DaemonFactory
from tests.helpers import DaemonProcess, RawConn, rss
from transferd.protocol.constants import Command
from transferd.protocol.frames import encode_frame

MiB = 1 << 20


def _rss_mib(d: DaemonProcess) -> float:
    return rss(d) / (1 << 20)


@pytest.fixture(autouse=True)
def _descriptors() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 4096)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if want < 1200:
        pytest.skip(f"needs 1,200 descriptors, RLIMIT_NOFILE allows {want}")


def test_idle_authenticated_connections_cost_little(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    before = _rss_mib(d)
    conns = []
    for _ in range(1000):
        c = RawConn.to(d, timeout=30)
        c.hello()
        conns.append(c)
    assert not conns[-1].request(Command.GET_DEVICES, {}).is_error
    grew = _rss_mib(d) - before
    for c in conns:
        c.close()
    assert grew < 64, f"1,000 idle connections took {grew:.0f} MiB (was 257)"


def test_a_large_body_does_not_stay_with_its_connection(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory()
    before = _rss_mib(d)
    conns = []
    for _ in range(60):
        c = RawConn.to(d, timeout=30)
        c.hello()
        f = c.request(Command.STATS, {"junk": b"\0" * (4 * MiB - 100)})
        assert not f.is_error, f
        conns.append(c)
    time.sleep(0.5)
    grew = _rss_mib(d) - before
    for c in conns:
        c.close()
    assert grew < 48, f"60 connections that each sent one 4 MiB body kept {grew:.0f} MiB " \
                      "(was 244)"


def test_a_busy_connection_still_reads_in_large_pieces_and_every_byte_lands(
        daemon_factory: DaemonFactory) -> None:
    """What the buffer is for: many small pipelined SETs (each through the buffer, under
    the 64 KiB that goes straight to a tensor), bodies over 8 KiB, and a 4 MiB body, on
    one connection, then GETs: every byte where it was sent (sha256), and after it, the
    connection quiet, its buffer small again."""
    d = daemon_factory()
    c = RawConn.to(d, timeout=60)
    c.hello()
    size = 4 * MiB
    buf = c.request(Command.ALLOC_BUFFER, {"device": "cpu", "size": size}).body["buffer"]
    data = os.urandom(size)
    piece = 4096
    frames = [encode_frame(Command.SET_TENSOR, 0, 100 + i, {"tensor": [buf, i * piece, piece]},
                           piece) + data[i * piece:(i + 1) * piece]
              for i in range(size // piece)]
    c.send_raw(b"".join(frames))
    for i in range(size // piece):
        f = c.recv()
        assert not f.is_error and f.seq == 100 + i, f
    # Bodies larger than the small buffer: a 20 KiB one, then a 4 MiB one.
    for n in (20_000, 4 * MiB - 100):
        assert not c.request(Command.STATS, {"junk": b"\1" * n}).is_error
    got = c.request(Command.GET_TENSOR, {"tensor": [buf, 0, size]})
    assert got.payload is not None
    assert hashlib.sha256(bytes(got.payload)).hexdigest() == hashlib.sha256(data).hexdigest()
    c.close()
